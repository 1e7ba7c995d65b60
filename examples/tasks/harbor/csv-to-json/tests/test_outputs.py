import json
import unittest


class TestJson(unittest.TestCase):
    def test_rows(self):
        rows = json.load(open("/app/people.json"))
        self.assertEqual(rows, [
            {"name": "Ada", "age": 36, "city": "London"},
            {"name": "Linus", "age": 28, "city": "Helsinki"},
            {"name": "Grace", "age": 45, "city": "Arlington"},
        ])


if __name__ == "__main__":
    unittest.main(verbosity=2)
