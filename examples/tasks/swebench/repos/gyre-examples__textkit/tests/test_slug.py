import unittest

from textkit.slug import slugify


class TestSlug(unittest.TestCase):
    def test_simple(self):
        self.assertEqual(slugify("Hello World"), "hello-world")
