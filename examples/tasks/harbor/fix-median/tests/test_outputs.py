import sys
import unittest

sys.path.insert(0, "/app")
from stats import mean, median  # noqa: E402


class TestStats(unittest.TestCase):
    def test_median_odd(self):
        self.assertEqual(median([3, 1, 2]), 2)

    def test_median_even(self):
        self.assertEqual(median([4, 1, 3, 2]), 2.5)

    def test_mean_unchanged(self):
        self.assertEqual(mean([1, 2, 3, 6]), 3)


if __name__ == "__main__":
    unittest.main(verbosity=2)
