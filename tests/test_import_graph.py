"""gyre/'s packages import only their own layer and those below it (tools/import_graph.py's LAYERS)."""

import pytest

from tools.import_graph import LAYER_OF, import_graph, long_functions

pytestmark = pytest.mark.unit


def test_no_package_imports_one_above_it():
    edges, upward = import_graph()
    assert {p for edge in edges for p in edge} <= set(LAYER_OF), "a package without a layer: add it to LAYERS"
    assert upward == []
    assert ("harness", "tasks") in edges and ("sched", "train") in edges  # the walk read real imports


def test_long_functions_are_measured_from_the_source():
    found = long_functions(60)
    assert all(n > 60 for n, _ in found) and found == sorted(found, reverse=True)
