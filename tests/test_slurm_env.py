import subprocess
import sys

import pytest

from gyre.comm.control import CellLayout
from gyre.sched.launch.slurm_env import (
    NotInSlurmStep,
    cell_of_task,
    cell_rank_from_env,
    node_of_task,
    parse_tasks_per_node,
    place_in_job,
)

pytestmark = pytest.mark.unit

# The environment of `srun --het-group=0,1,2` in a job of 1, 2 and 1 tasks, as observed on Slurm 22.05.
HET = {"SLURM_HET_SIZE": "3", "SLURM_NTASKS_HET_GROUP_0": "1", "SLURM_NTASKS_HET_GROUP_1": "2"}
HET |= {"SLURM_NTASKS_HET_GROUP_2": "1", "SLURM_STEP_NUM_TASKS": "4"}


def test_tasks_are_numbered_component_by_component():
    sizes = [1, 2, 1]
    assert [cell_of_task(p, sizes, [0, 1, 2]) for p in range(4)] == [(0, 0), (1, 0), (1, 1), (2, 0)]
    assert [cell_of_task(p, sizes, [1, 2]) for p in range(3)] == [(1, 0), (1, 1), (2, 0)]
    with pytest.raises(ValueError, match="outside a step of 4 tasks"):
        cell_of_task(4, sizes, [0, 1, 2])


def test_step_over_all_components():
    ranks = [cell_rank_from_env(HET | {"SLURM_PROCID": str(p)}) for p in range(4)]
    assert [(r.cell, r.local_rank, r.cell_size, r.role) for r in ranks] == [
        (0, 0, 1, "core"),
        (1, 0, 2, "satellite"),
        (1, 1, 2, "satellite"),
        (2, 0, 1, "satellite"),
    ]
    assert {(r.world_size, r.num_cells) for r in ranks} == {(4, 3)}


def test_step_over_some_components_names_them():
    env = HET | {"SLURM_STEP_NUM_TASKS": "3", "GYRE_HET_GROUPS": "1,2"}
    assert cell_rank_from_env(env | {"SLURM_PROCID": "2"}).cell == 2
    with pytest.raises(ValueError, match="GYRE_HET_GROUPS"):  # the counts of all groups do not add up to 3
        cell_rank_from_env(HET | {"SLURM_STEP_NUM_TASKS": "3", "SLURM_PROCID": "2"})
    with pytest.raises(ValueError, match="among 0..2"):
        cell_rank_from_env(env | {"SLURM_PROCID": "0", "GYRE_HET_GROUPS": "1,5"})


def test_per_cell_step_keeps_its_own_layout():
    env = HET | {"SLURM_STEP_NUM_TASKS": "8", "GYRE_HET_GROUPS": "1", "SLURM_PROCID": "5"}
    rank = cell_rank_from_env(env)
    assert (rank.cell, rank.local_rank, rank.cell_size, rank.world_size) == (1, 5, 8, 8)


def test_plain_job_is_one_core_cell():
    rank = cell_rank_from_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2"})
    assert (rank.cell, rank.role, rank.local_rank, rank.num_cells) == (0, "core", 1, 1)


def test_outside_slurm_says_so():
    with pytest.raises(NotInSlurmStep, match="srun"):
        cell_rank_from_env({})
    proc = subprocess.run(
        [sys.executable, "-m", "gyre.sched.launch.slurm_env"],
        env={"PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "run this inside a Slurm step" in proc.stderr


# `srun --het-group=0 --nodes=2 --ntasks=3 --distribution=block : --het-group=1 --ntasks-per-node=2` in a job of
# components 2 nodes x (2, 1) tasks and 1 node x 2 tasks (cluster=slurm_cpu_tp2_nodes), as observed on Slurm 22.05
SPAN = {"SLURM_HET_SIZE": "2", "GYRE_HET_TASKS": "3,2", "SLURM_STEP_NUM_TASKS": "5"}
SPAN |= {"SLURM_STEP_TASKS_PER_NODE": "2,1,2", "SLURM_STEP_NODELIST": "node[1-3]"}
SPAN_TASKS = [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1)]  # SLURM_NODEID, SLURM_LOCALID of tasks 0..4


def _span_task(procid: int, **changes: str) -> dict[str, str]:
    node, local = SPAN_TASKS[procid]
    return SPAN | {"SLURM_PROCID": str(procid), "SLURM_NODEID": str(node), "SLURM_LOCALID": str(local)} | changes


def test_tasks_per_node_syntax():
    assert parse_tasks_per_node("2,1,2") == [2, 1, 2] and parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert [node_of_task(p, [2, 1, 2]) for p in range(5)] == [0, 0, 1, 2, 2]


def test_a_cell_over_two_nodes_finds_each_rank_s_node_and_place():
    ranks = [cell_rank_from_env(_span_task(p)) for p in range(5)]
    assert [(r.cell, r.local_rank, r.node, r.nodes, r.local_id) for r in ranks] == [
        (0, 0, 0, 2, 0),  # the controller, on the core's first node
        (0, 1, 0, 2, 1),  # core rank 0 beside it
        (0, 2, 1, 2, 0),  # core rank 1 on the core's second node
        (1, 0, 0, 1, 0),
        (1, 1, 0, 1, 1),
    ]
    places = [place_in_job(r, [1, 2]) for r in ranks]
    assert [(p.cell, p.rank, p.node) for p in places] == [(-1, 0, 0), (0, 0, 0), (0, 1, 1), (1, 0, 0), (1, 1, 0)]
    layout = CellLayout.from_places([(p.cell, p.rank) for p in places])
    assert layout.controller == 0 and layout.cells == ((1, 2), (3, 4))


def test_a_task_elsewhere_than_the_layout_says_is_refused_with_the_key():
    with pytest.raises(ValueError, match="laid out node by node"):  # SLURM_NODEID disagrees with block numbering
        cell_rank_from_env(_span_task(2, SLURM_NODEID="0"))
    # both core ranks on one node while the config spreads them over 2 nodes x 1 task
    packed = cell_rank_from_env(_span_task(2, SLURM_STEP_TASKS_PER_NODE="3,2", SLURM_NODEID="0"))
    with pytest.raises(ValueError, match=r"rank 1 of cell 0 \(task 2\) runs on node 0.*cluster.core.tasks_per_node=1"):
        place_in_job(packed, [1, 2])
    with pytest.raises(ValueError, match="one controller"):
        CellLayout.from_places([(0, 0), (0, 1)])
