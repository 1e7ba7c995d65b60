"""The job step of a heterogeneous Slurm job, and the layout of its tasks.

Component 0 is the core cell, components 1..N the satellite cells. The cell job is one MPI program
(`python -m mpi4py -m gyre.sched.job RUN_DIR`), started by one `srun` over every component with a
single MPI_COMM_WORLD: rank 0 is the controller (proxy, harness sessions, scheduler) on the core
cell's node, rank 1 the core cell, rank 1+i satellite cell i. Each cell rank starts its cell's
rollout engine (the embedded engine, or an SGLang server over `engine.tp_size` GPUs) and holds its
Megatron training replica; engine and trainer settings come from the resolved config the step reads.

A cell is one node of `tasks_per_node` ranks (rank 0 of the core after the controller, on the same
node): its Megatron world of train.tensor_parallel x pipeline_parallel ranks, the first of which also
runs the engine and talks to the controller. Cells of several nodes are not implemented yet; that
and every other layout the cell runtime cannot hold fail here, with the key to change.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from gyre.config.schema import CellResources, RunConfig
from gyre.config.validate import ConfigValueError, check_cells

JOB_MODULE = "gyre.sched.job"


class LayoutError(ValueError):
    """A layout that the cells' resources or the cell runtime cannot hold."""


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
        from gyre.sched.job_preflight import GLOO_UNSUPPORTED

        raise LayoutError(GLOO_UNSUPPORTED)
    for cell, res in enumerate(cells(cfg)):
        if res.nodes != 1:
            raise LayoutError(
                f"{cell_key(cell)}.nodes={res.nodes}: a cell is one node of {cell_key(cell)}.tasks_per_node ranks "
                f"(cells of several nodes are not implemented yet); set {cell_key(cell)}.nodes=1 and add satellites "
                "for more nodes"
            )
        if cfg.engine.backend == "sglang" and cfg.engine.tp_size > max(res.gpus_per_node, 0):
            raise LayoutError(
                f"engine.tp_size={cfg.engine.tp_size} needs that many GPUs on one node, but {cell_key(cell)} has "
                f"gpus_per_node={res.gpus_per_node}; lower engine.tp_size or give the cell more GPUs"
            )
    try:  # each cell's ranks hold exactly its trainer's model-parallel layout
        check_cells(cfg)
    except ConfigValueError as e:
        raise LayoutError(str(e)) from e


def _cpus(res: CellResources, tasks: int) -> int:
    return max(1, res.cpus_per_node // tasks)


def plan_step(cfg: RunConfig, argv: list[str]) -> Step:
    """The cell job's step: the controller and the core cell's ranks share component 0, each other cell's
    ranks its component."""
    check_layout(cfg)
    components = []
    for cell, res in enumerate(cells(cfg)):
        tasks = res.tasks_per_node + (1 if cell == 0 else 0)  # the controller shares the core's node
        args = [f"--ntasks={tasks}", f"--ntasks-per-node={tasks}", f"--cpus-per-task={_cpus(res, tasks)}"]
        if res.gpus_per_node:  # every task of the node sees all its GPUs: the cell's engine and replica share them
            args.append(f"--gpus-per-node={res.gpus_per_node}")
        components.append(Component(cell, tasks, tuple(args)))
    return Step("cells", tuple(components), tuple(argv), cfg.cluster.mpi)
