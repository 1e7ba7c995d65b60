import unittest

from calc.ops import add, div, mean, mul, power


class TestOps(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

    def test_mul(self):
        self.assertEqual(mul(4, 5), 20)

    def test_div(self):
        self.assertEqual(div(7, 2), 3.5)

    def test_power(self):
        self.assertEqual(power(3, 2), 9)

    def test_mean(self):
        self.assertEqual(mean([1, 2, 6]), 3)
