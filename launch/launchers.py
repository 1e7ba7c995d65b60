"""Where a run's launcher is chosen, the one place (gyre.sched.launch.launcher.Launcher): on this machine for
`launch.run` (one cell in this process, else mpirun), on Slurm for `launch.submit` (submitit or sbatch)."""

from __future__ import annotations

from enum import StrEnum

from gyre.config.schema import RunConfig
from gyre.sched.launch.launcher import Launcher


class Via(StrEnum):
    local = "local"  # launch.run: this machine
    submitit = "submitit"  # launch.submit's default
    sbatch = "sbatch"


SLURM_VIAS = (Via.submitit, Via.sbatch)


def launcher_for(cfg: RunConfig, via: Via) -> Launcher:
    if via is Via.local:
        from gyre.sched.launch.local import local_launcher  # torch and megatron follow: only for a local run

        return local_launcher(cfg)
    from launch.slurm.launchers import SbatchLauncher, SubmititLauncher

    return SbatchLauncher() if via is Via.sbatch else SubmititLauncher()
