import subprocess
import sys

import pytest

from gyre.sched.slurm_env import NotInSlurmStep, cell_of_task, cell_rank_from_env

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
        [sys.executable, "-m", "gyre.sched.slurm_env"], env={"PATH": ""}, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "run this inside a Slurm step" in proc.stderr
