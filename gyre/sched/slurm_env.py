"""Which cell a Slurm task belongs to, from Slurm's environment (pure; no Slurm calls).

In a heterogeneous job, component 0 is the core cell and components 1..N are satellite cells. In a
step that spans several components (`srun --het-group=0,1,2`), `SLURM_PROCID` counts across them
and no variable names a task's component, so the cell is derived from `SLURM_PROCID` and the
per-component task counts `SLURM_NTASKS_HET_GROUP_x`. Those counts describe the allocation, not the
step: a step with its own counts per component (`srun A : B : C`, as the generated sbatch script
runs the cell job) gives them in `GYRE_HET_TASKS=2,1,1`, and a step over only some components says
which (`GYRE_HET_GROUPS=1,2`); the sum is checked against `SLURM_STEP_NUM_TASKS`. A step over one
component may have any task layout.

`python -m gyre.sched.slurm_env` prints one line per task: a quick check of a job's layout.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

HET_GROUPS_VAR = "GYRE_HET_GROUPS"
HET_TASKS_VAR = "GYRE_HET_TASKS"  # a step's tasks per component ("2,1,1"), when they differ from the allocation's
# set by the generated script for each start of the cell job: rank 0 creates WORLD_UP_VAR's file once
# every rank is past MPI_Init; START_ATTEMPT_VAR counts the starts of this run of the script (1, 2, ...)
WORLD_UP_VAR = "GYRE_WORLD_UP_FILE"
START_ATTEMPT_VAR = "GYRE_START_ATTEMPT"


class NotInSlurmStep(RuntimeError):
    """The process was not started by srun (no SLURM_PROCID)."""


@dataclass(frozen=True)
class CellRank:
    cell: int  # het component: 0 = core cell, 1..N = satellite cells
    rank: int  # SLURM_PROCID: position among all tasks of the step
    local_rank: int  # position among the step's tasks in this cell
    cell_size: int  # tasks of this cell in the step
    world_size: int  # tasks in the step
    num_cells: int  # components in the job (1 for a plain job)

    @property
    def role(self) -> str:
        return "core" if self.cell == 0 else "satellite"


def cell_of_task(procid: int, tasks_per_group: Sequence[int], groups: Sequence[int]) -> tuple[int, int]:
    """(component, index within it) of task `procid` in a step over `groups`, in that order.

    `tasks_per_group[g]` is the task count of component g; tasks are numbered component by component.
    """
    offset = 0
    for group in groups:
        size = tasks_per_group[group]
        if procid < offset + size:
            return group, procid - offset
        offset += size
    raise ValueError(f"task {procid} is outside a step of {offset} tasks over het groups {list(groups)}")


def _parse_groups(text: str, num_groups: int) -> list[int]:
    groups = [int(part) for part in text.replace(" ", "").split(",") if part]
    bad = [g for g in groups if not 0 <= g < num_groups]
    if not groups or bad:
        raise ValueError(f"{HET_GROUPS_VAR}={text!r}: expected het groups among 0..{num_groups - 1}")
    return groups


def cell_rank_from_env(env: Mapping[str, str]) -> CellRank:
    """The calling task's cell, from a Slurm step environment (os.environ inside `srun`)."""
    if "SLURM_PROCID" not in env:
        raise NotInSlurmStep("SLURM_PROCID is not set: run this inside a Slurm step (srun), not on a login node")
    procid = int(env["SLURM_PROCID"])
    step_tasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or procid + 1)
    num_groups = int(env.get("SLURM_HET_SIZE", "0"))
    if num_groups == 0:  # a plain (non-heterogeneous) job is a single core cell
        return CellRank(
            cell=0, rank=procid, local_rank=procid, cell_size=step_tasks, world_size=step_tasks, num_cells=1
        )
    groups = _parse_groups(env[HET_GROUPS_VAR], num_groups) if HET_GROUPS_VAR in env else list(range(num_groups))
    if len(groups) == 1:  # a per-cell step: its own task layout, whatever the allocation's
        cell = groups[0]
        return CellRank(cell, procid, procid, step_tasks, step_tasks, num_groups)
    if HET_TASKS_VAR in env:
        tasks_per_group = [int(n) for n in env[HET_TASKS_VAR].split(",")]
        if len(tasks_per_group) != num_groups:
            raise ValueError(f"{HET_TASKS_VAR}={env[HET_TASKS_VAR]!r} must give one count per het component")
    else:
        tasks_per_group = [int(env[f"SLURM_NTASKS_HET_GROUP_{g}"]) for g in range(num_groups)]
    spanned = sum(tasks_per_group[g] for g in groups)
    if spanned != step_tasks:
        raise ValueError(
            f"het groups {groups} hold {spanned} tasks but this step has {step_tasks}: a step over only some "
            f"components must name them in {HET_GROUPS_VAR}, and a step with its own task counts per component "
            f"must give them in {HET_TASKS_VAR} (the generated sbatch script does)"
        )
    cell, local_rank = cell_of_task(procid, tasks_per_group, groups)
    return CellRank(
        cell=cell,
        rank=procid,
        local_rank=local_rank,
        cell_size=tasks_per_group[cell],
        world_size=step_tasks,
        num_cells=num_groups,
    )


def start_attempt(env: Mapping[str, str]) -> int:
    """Which start of the cell job this is, under the generated script (1 elsewhere)."""
    return int(env.get(START_ATTEMPT_VAR, "1"))


def mark_world_up(env: Mapping[str, str]) -> None:
    """Tell the generated script that the MPI world is up (rank 0, once every rank has joined it)."""
    if path := env.get(WORLD_UP_VAR):
        with open(path, "w") as f:
            f.write(f"{os.getpid()}\n")


def describe(rank: CellRank, env: Mapping[str, str]) -> str:
    node = env.get("SLURMD_NODENAME", "?")
    return (
        f"rank={rank.rank} cell={rank.cell} role={rank.role} local_rank={rank.local_rank} "
        f"cell_size={rank.cell_size} world_size={rank.world_size} num_cells={rank.num_cells} node={node}"
    )


def main() -> None:
    try:
        rank = cell_rank_from_env(os.environ)
    except (NotInSlurmStep, ValueError) as e:
        sys.exit(f"gyre.sched.slurm_env: {e}")
    print(describe(rank, os.environ), flush=True)


if __name__ == "__main__":
    main()
