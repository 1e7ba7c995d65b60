"""The job step of a heterogeneous Slurm job, and the layout of its tasks.

Component 0 is the core cell, components 1..N the satellite cells. The cell job is one MPI program
(`python -m mpi4py -m gyre.sched.launch.job RUN_DIR`), started by one `srun` over every component with a
single MPI_COMM_WORLD: rank 0 is the controller (proxy, harness sessions, scheduler) on the core
cell's first node, then the core cell's ranks, then each satellite cell's. Each cell's leader starts its
cell's rollout engine (the embedded engine, or an SGLang server over `engine.tp_size` GPUs) and all its
ranks hold its Megatron training replica; engine and trainer settings come from the resolved config.

A cell is `nodes` x `tasks_per_node` ranks, `tasks_per_node` on each of its nodes in order (the
controller first on the core's first node, beside the core's first ranks): its Megatron world of
train.tensor_parallel x pipeline_parallel ranks, the first of which also runs the engine and talks to
the controller. Each component asks Slurm for exactly its tasks (`ComponentLayout`: tasks on each node,
CPUs per task, the node's GPUs); the step runs them under the block distribution, and each rank checks
where it landed (gyre.sched.launch.slurm_env.place_in_job). Every layout the cell runtime cannot hold fails
here, before submitting, with the key to change.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from gyre.config.schema import CellResources, RunConfig
from gyre.config.validate import ConfigValueError, check_cells
from gyre.errors import UserError

JOB_MODULE = "gyre.sched.launch.job"


class LayoutError(UserError, ValueError):
    """A layout that the cells' resources or the cell runtime cannot hold."""


@dataclass(frozen=True)
class ComponentLayout:
    """What one het component asks Slurm for: its cell's ranks (and on component 0 the controller, a task on
    the first node), the CPUs of each task, the GPUs of each node (shared by the node's tasks: the cell's
    engine and its trainer ranks)."""

    nodes: int
    tasks: int  # in all
    tasks_per_node: int  # on the busiest node (the core's first, which also holds the controller)
    cpus_per_task: int
    gpus_per_node: int

    @property
    def uniform(self) -> bool:
        return self.tasks == self.nodes * self.tasks_per_node

    def slurm_args(self) -> list[str]:
        """`--nodes`, tasks (per node where every node has the same), `--cpus-per-task`, `--gres`."""
        tasks = [f"--ntasks-per-node={self.tasks_per_node}"] if self.uniform else [f"--ntasks={self.tasks}"]
        gres = [f"--gres=gpu:{self.gpus_per_node}"] if self.gpus_per_node else []
        return [f"--nodes={self.nodes}", *tasks, f"--cpus-per-task={self.cpus_per_task}", *gres]


def component_layout(cell: int, res: CellResources) -> ComponentLayout:
    """Cell `cell`'s tasks; LayoutError naming the key when its node cannot hold them."""
    key = cell_key(cell)
    busiest = res.tasks_per_node + (1 if cell == 0 else 0)  # the controller shares the core's first node
    cpus = res.cpus_per_node // busiest
    if cpus < 1:
        who = f"{res.tasks_per_node} rank(s) and the controller" if cell == 0 else f"{res.tasks_per_node} rank(s)"
        raise LayoutError(
            f"{key}.cpus_per_node={res.cpus_per_node}: its first node runs {who}, one CPU each at least; "
            f"set {key}.cpus_per_node to {busiest} or more"
        )
    if res.gpus_per_node and res.tasks_per_node > res.gpus_per_node:
        raise LayoutError(
            f"{key}.tasks_per_node={res.tasks_per_node} exceeds {key}.gpus_per_node={res.gpus_per_node}: a GPU cell "
            f"runs at most one rank per GPU; lower {key}.tasks_per_node or give the node more GPUs"
        )
    tasks = res.nodes * res.tasks_per_node + (1 if cell == 0 else 0)
    return ComponentLayout(res.nodes, tasks, busiest, cpus, res.gpus_per_node)


@dataclass(frozen=True)
class Component:
    group: int  # het component = cell
    tasks: int  # ranks of the cell job on this component
    srun_args: tuple[str, ...]


@dataclass(frozen=True)
class Step:
    name: str  # also the log file stem: <log_dir>/<job id>_<name>_<SLURM_PROCID>.out
    components: tuple[Component, ...]
    argv: tuple[str, ...]
    mpi: str  # srun --mpi; empty: the cluster's MpiDefault

    @property
    def het_groups(self) -> tuple[int, ...]:
        return tuple(c.group for c in self.components)

    @property
    def num_tasks(self) -> int:
        return sum(c.tasks for c in self.components)


def cells(cfg: RunConfig) -> list[CellResources]:
    return [cfg.cluster.core, *cfg.cluster.satellites]


def cell_key(cell: int) -> str:
    """The config key of a cell's resources, for error messages."""
    return "cluster.core" if cell == 0 else f"cluster.satellites.{cell - 1}"


def cluster_python(cfg: RunConfig) -> str:
    """The interpreter the nodes run: cluster.python, or this one by absolute path; a bare name only after a
    setup line (which would put the run's environment on the PATH)."""
    python = cfg.cluster.python or sys.executable
    if not os.path.isabs(python) and not cfg.cluster.setup:
        raise LayoutError(
            f"cluster.python={python!r} runs whatever {python!r} each node's PATH finds first; leave it empty (this "
            f"interpreter, {sys.executable}), give an absolute path on a filesystem the nodes share, or add a "
            "cluster.setup line that activates the run's environment (e.g. 'source /shared/gyre/.venv/bin/activate')"
        )
    return python


def job_command(cfg: RunConfig, run_dir: str) -> list[str]:
    """argv of every task of the cell job: `-m mpi4py` turns an exception on any rank into MPI_Abort."""
    return [cluster_python(cfg), "-m", "mpi4py", "-m", JOB_MODULE, run_dir]


def check_layout(cfg: RunConfig) -> None:
    if cfg.comm.transfer_backend == "gloo":
        from gyre.sched.launch.job_preflight import GLOO_UNSUPPORTED

        raise LayoutError(GLOO_UNSUPPORTED)
    for cell, res in enumerate(cells(cfg)):
        if res.nodes < 1 or res.tasks_per_node < 1:
            what = "nodes" if res.nodes < 1 else "tasks_per_node"
            raise LayoutError(f"{cell_key(cell)}.{what}={getattr(res, what)}: a cell needs at least 1")
        component_layout(cell, res)
    try:  # each cell's ranks hold exactly its trainer's model-parallel layout, and its engine its GPUs
        check_cells(cfg)
    except ConfigValueError as e:
        raise LayoutError(str(e)) from e


def plan_step(cfg: RunConfig, argv: list[str]) -> Step:
    """The cell job's step: the controller and the core cell's ranks on component 0, each other cell's ranks
    on its component, `tasks_per_node` per node in order (block distribution: a cell's ranks numbered node by
    node, the controller first)."""
    check_layout(cfg)
    components = []
    for cell, res in enumerate(cells(cfg)):
        layout = component_layout(cell, res)
        total = [f"--ntasks={layout.tasks}"] if layout.uniform else []  # else slurm_args gives it
        args = [*total, *layout.slurm_args(), "--distribution=block"]
        components.append(Component(cell, layout.tasks, tuple(args)))
    return Step("cells", tuple(components), tuple(argv), cfg.cluster.mpi)
