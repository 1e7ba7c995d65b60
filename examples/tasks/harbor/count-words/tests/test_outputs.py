import unittest
from pathlib import Path


class TestCounts(unittest.TestCase):
    def test_counts(self):
        lines = Path("/app/counts.csv").read_text().split()
        self.assertEqual(lines, ["alpha.txt,6", "beta.txt,2", "gamma.txt,7"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
