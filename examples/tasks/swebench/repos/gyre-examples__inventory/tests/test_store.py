import unittest

from inventory.store import Inventory


class TestInventory(unittest.TestCase):
    def test_add(self):
        inv = Inventory()
        inv.add("apple", 3)
        self.assertEqual(inv.stock["apple"], 3)

    def test_remove(self):
        inv = Inventory()
        inv.add("apple", 3)
        inv.remove("apple", 2)
        self.assertEqual(inv.stock["apple"], 1)
