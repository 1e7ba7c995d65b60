import unittest

from notes.reader import read_note


class TestNote(unittest.TestCase):
    def test_missing_is_empty(self):
        self.assertEqual(read_note("missing.txt"), "")
