"""Which cell a Slurm task belongs to, from Slurm's environment (pure; no Slurm calls).

In a heterogeneous job, component 0 is the core cell and components 1..N are satellite cells. In a
step that spans several components (`srun --het-group=0,1,2`), `SLURM_PROCID` counts across them
and no variable names a task's component, so the cell is derived from `SLURM_PROCID` and the
per-component task counts `SLURM_NTASKS_HET_GROUP_x`. Those counts describe the allocation, not the
step: a step with its own counts per component (`srun A : B : C`, as the generated sbatch script
runs the cell job) gives them in `GYRE_HET_TASKS=2,1,1`, and a step over only some components says
which (`GYRE_HET_GROUPS=1,2`); the sum is checked against `SLURM_STEP_NUM_TASKS`. A step over one
component may have any task layout.

A cell may span nodes. Where a task runs comes from the step's own layout: `SLURM_STEP_TASKS_PER_NODE`
("2,1,2" or "2(x2),1": tasks on each node of `SLURM_STEP_NODELIST`, numbered node by node under the block
distribution) and `SLURM_NODEID` (this task's node in that list), checked against each other; a task's
node within its component is its node less the component's first. `place_in_job` turns that into the
task's place in the cell job: its cell, its rank in the cell and which of the cell's nodes it is on, and
refuses a layout other than `tasks_per_node` ranks per node with the controller first on the core's first.

`python -m gyre.sched.launch.slurm_env` prints one line per task: a quick check of a job's layout.
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
# rank 0 writes its exit status there: the job's, rather than srun's worst task status (a satellite the run
# went on without exits 137; the controller's 0 or DEAD_CELLS_EXIT_CODE says what the run came to)
EXIT_STATUS_VAR = "GYRE_EXIT_STATUS_FILE"


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
    node: int = 0  # which of its component's nodes in this step the task runs on (0: the component's first)
    nodes: int = 1  # nodes of its component in this step
    local_id: int = 0  # SLURM_LOCALID: position among this step's tasks on its node

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


def parse_tasks_per_node(text: str) -> list[int]:
    """Slurm's tasks-per-node syntax ("2,1,2", "2(x3),1") as one count per node."""
    counts: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        count, _, times = part.partition("(x")
        counts += [int(count)] * (int(times.rstrip(")")) if times else 1)
    return counts


def node_of_task(procid: int, tasks_per_node: Sequence[int]) -> int:
    """The node (index in the step's node list) of task `procid` when tasks are numbered node by node."""
    offset = 0
    for node, count in enumerate(tasks_per_node):
        offset += count
        if procid < offset:
            return node
    raise ValueError(f"task {procid} is outside a step of {offset} tasks on {len(tasks_per_node)} nodes")


def _nodes_of(env: Mapping[str, str], procid: int, first: int, size: int) -> tuple[int, int]:
    """(this task's node within the component whose tasks are first..first+size-1, the component's nodes)."""
    text = env.get("SLURM_STEP_TASKS_PER_NODE")
    if not text or "SLURM_NODEID" not in env:
        return 0, 1
    tpn = parse_tasks_per_node(text)
    node_id, expected = int(env["SLURM_NODEID"]), node_of_task(procid, tpn)
    if node_id != expected:
        raise ValueError(
            f"task {procid} runs on node {node_id} of the step but SLURM_STEP_TASKS_PER_NODE={text} puts it on node "
            f"{expected}: the step's tasks must be laid out node by node (srun --distribution=block, as the "
            "generated sbatch script asks)"
        )
    start = node_of_task(first, tpn)
    return node_id - start, node_of_task(first + size - 1, tpn) - start + 1


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
    local_id = int(env.get("SLURM_LOCALID", "0"))
    if num_groups == 0:  # a plain (non-heterogeneous) job is a single core cell
        node, nodes = _nodes_of(env, procid, 0, step_tasks)
        return CellRank(0, procid, procid, step_tasks, step_tasks, 1, node, nodes, local_id)
    groups = _parse_groups(env[HET_GROUPS_VAR], num_groups) if HET_GROUPS_VAR in env else list(range(num_groups))
    if len(groups) == 1:  # a per-cell step: its own task layout, whatever the allocation's
        node, nodes = _nodes_of(env, procid, 0, step_tasks)
        return CellRank(groups[0], procid, procid, step_tasks, step_tasks, num_groups, node, nodes, local_id)
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
    node, nodes = _nodes_of(env, procid, procid - local_rank, tasks_per_group[cell])
    return CellRank(
        cell=cell,
        rank=procid,
        local_rank=local_rank,
        cell_size=tasks_per_group[cell],
        world_size=step_tasks,
        num_cells=num_groups,
        node=node,
        nodes=nodes,
        local_id=local_id,
    )


@dataclass(frozen=True)
class CellPlace:
    """A task's place in the cell job: component 0 holds the controller (its first task), then the core
    cell's ranks; component i satellite cell i's. A cell's ranks fill its nodes in order, `tasks_per_node`
    on each (the controller beside the core's first)."""

    cell: int  # -1: the controller
    rank: int  # in the cell (0: its leader); 0 for the controller
    node: int  # which of the cell's nodes (0: its leader's)
    local_id: int  # SLURM_LOCALID


def place_in_job(task: CellRank, tasks_per_node: Sequence[int]) -> CellPlace:
    """Where `task` sits in the cell job whose cell i has `tasks_per_node[i]` ranks on each of its nodes;
    ValueError for a task that Slurm put elsewhere than that layout says."""
    if task.cell == 0 and task.local_rank == 0:
        place = CellPlace(-1, 0, task.node, task.local_id)
        expected_node = 0
    else:
        rank = task.local_rank - (1 if task.cell == 0 else 0)
        place = CellPlace(task.cell, rank, task.node, task.local_id)
        expected_node = rank // tasks_per_node[task.cell]
    if task.node != expected_node:
        key = "cluster.core" if task.cell == 0 else f"cluster.satellites.{task.cell - 1}"
        who = "the controller" if place.cell < 0 else f"rank {place.rank} of cell {place.cell}"
        raise ValueError(
            f"{who} (task {task.rank}) runs on node {task.node} of its component, but {key}.tasks_per_node="
            f"{tasks_per_node[task.cell]} puts it on node {expected_node}: start the job with the generated sbatch "
            "script (launch/submit.py), which asks for that layout"
        )
    return place


def start_attempt(env: Mapping[str, str]) -> int:
    """Which start of the cell job this is, under the generated script (1 elsewhere)."""
    return int(env.get(START_ATTEMPT_VAR, "1"))


def mark_world_up(env: Mapping[str, str]) -> None:
    """Tell the generated script that the MPI world is up (rank 0, once every rank has joined it)."""
    if path := env.get(WORLD_UP_VAR):
        with open(path, "w") as f:
            f.write(f"{os.getpid()}\n")


def record_exit_status(env: Mapping[str, str], code: int) -> None:
    """Tell the generated script the status the controller (rank 0) decided for the job."""
    if path := env.get(EXIT_STATUS_VAR):
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{code}\n")
        os.replace(tmp, path)  # the script never reads half a number


def describe(rank: CellRank, env: Mapping[str, str]) -> str:
    node = env.get("SLURMD_NODENAME", "?")
    return (
        f"rank={rank.rank} cell={rank.cell} role={rank.role} local_rank={rank.local_rank} "
        f"cell_size={rank.cell_size} world_size={rank.world_size} num_cells={rank.num_cells} node={node} "
        f"node_in_cell={rank.node}/{rank.nodes} local_id={rank.local_id}"
    )


def main() -> None:
    try:
        rank = cell_rank_from_env(os.environ)
    except (NotInSlurmStep, ValueError) as e:
        sys.exit(f"gyre.sched.launch.slurm_env: {e}")
    print(describe(rank, os.environ), flush=True)


if __name__ == "__main__":
    main()
