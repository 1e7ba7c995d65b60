"""gyre/'s packages import only their own layer and those below it (tools/import_graph.py's LAYERS)."""

import pytest

from tools.import_graph import LAYER_OF, import_graph, long_functions, many_parameters

pytestmark = pytest.mark.unit


def test_no_package_imports_one_above_it():
    edges, upward = import_graph()
    assert {p for edge in edges for p in edge} <= set(LAYER_OF), "a package without a layer: add it to LAYERS"
    assert upward == []
    assert ("harness", "tasks") in edges and ("sched", "train") in edges  # the walk read real imports


def test_long_functions_are_measured_from_the_source():
    found = long_functions(40)
    assert found and all(n > 40 for n, _ in found) and found == sorted(found, reverse=True)


def test_no_function_runs_over_60_lines():
    assert long_functions(60) == []  # split it into helpers whose names say what each part does


def test_the_schedulers_functions_take_a_run_state_object_not_long_parameter_lists():
    """gyre/sched passes RunStart, ControllerContext, EngineSetup and CellParts rather than their parts: no
    function there takes more than 5 parameters but the rollout driver's constructor (6 collaborators)."""
    found = many_parameters(5, ("gyre/sched",))
    assert [where.split(":")[0] for _, where in found] == ["gyre/sched/controller/sessions.py"], found
    assert found[0][0] == 6 and found[0][1].endswith("__init__")
