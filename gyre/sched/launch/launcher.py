"""One interface over the ways a run starts, as submitit puts its Local, Debug and Slurm executors behind one:
here (one cell in this process, or an MPI job of cells under mpirun: gyre.sched.launch.local) or on Slurm
(a generated sbatch script, or submitit: launch/slurm/launchers.py). `render` is the dry run, what would be
started, as text; `launch` starts it. Which one a run gets is decided in one place, launch.launchers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gyre.config.schema import RunConfig


@dataclass(frozen=True)
class LaunchPlan:
    """A run ready to start: its resolved config (output_dir set), written to `config_path`, and where its
    launcher writes logs (Slurm's batch and step logs; a local run logs under `out`)."""

    cfg: RunConfig
    out: Path
    config_path: Path
    log_dir: Path


class Launcher(Protocol):
    def render(self, plan: LaunchPlan) -> str:
        """What `launch` would start: a command line or a batch script."""
        ...

    def launch(self, plan: LaunchPlan) -> int:
        """Start the run: a local one runs to its end here (0; failures raise, a stop signal's checkpoint raises
        Preempted); a Slurm one is submitted (its job id)."""
        ...
