"""The Slurm launchers (gyre.sched.launch.launcher.Launcher): the cell job as one heterogeneous job, submitted
as the generated sbatch script or through submitit (a job handle, logs and results in the log folder); and
an evaluation (launch.eval) as a one-node sbatch job."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from gyre.config.schema import RunConfig
from gyre.sched.launch.launcher import LaunchPlan
from launch.slurm.plan import cluster_python, job_command, plan_step
from launch.slurm.preflight import SlurmPreflightError
from launch.slurm.sbatch import ScriptLayout, render_eval_sbatch, render_sbatch


def plain_script(cfg: RunConfig, config_path: str, log_dir: str) -> str:
    """The sbatch script a user can submit with `sbatch`: the cell job over every component."""
    step = plan_step(cfg, job_command(cfg, str(Path(config_path).parent)))
    return render_sbatch(cfg, step, ScriptLayout(log_dir=log_dir, config_path=config_path, start_guard=True))


def run_cell_job(run_dir: str) -> dict[str, Any]:
    """What each task runs under submitit (imported there: importing MPI here would initialise it)."""
    from gyre.sched.launch.job import submitit_main

    return submitit_main(run_dir)


def sbatch(script: Path) -> int:
    proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise SlurmPreflightError(f"sbatch refused the job: {proc.stderr.strip()}")
    return int(proc.stdout.strip().split(";")[0])


class SbatchLauncher:
    """`sbatch` of the generated script (written beside the config as gyre.sbatch, for the user to read or resubmit)."""

    def render(self, plan: LaunchPlan) -> str:
        return plain_script(plan.cfg, str(plan.config_path), str(plan.log_dir))

    def launch(self, plan: LaunchPlan) -> int:
        script = plan.out / "gyre.sbatch"
        script.write_text(self.render(plan))
        return sbatch(script)


class SubmititLauncher:
    """submitit's executor over the same script (launch.slurm.het_executor): the job handle, logs and every
    task's result in the log folder."""

    def render(self, plan: LaunchPlan) -> str:
        """The script submitit submits: each task unpickles the call from the log folder."""
        executor = self._executor(plan)
        return executor._make_submission_file_text(executor._submitit_command_str, "")

    def launch(self, plan: LaunchPlan) -> int:
        return int(self._executor(plan).submit(run_cell_job, str(plan.out)).job_id)

    @staticmethod
    def _executor(plan: LaunchPlan) -> Any:
        from launch.slurm.het_executor import HetSlurmExecutor  # submitit: only when this launcher is used

        return HetSlurmExecutor(plan.log_dir, plan.cfg, config_path=str(plan.config_path), start_guard=True)


EVAL_SCRIPT = "gyre-eval.sbatch"


def eval_argv(cfg: RunConfig, overrides: list[str], out_dir: Path) -> list[str]:
    """The node's command: launch.eval with the submitted overrides, its output in out_dir."""
    own = ("output_dir=", "hydra.run.dir=")
    kept = [o for o in overrides if not o.lstrip("+~").startswith(own)]
    return [
        cluster_python(cfg),
        "-m",
        "launch.eval",
        *kept,
        f"output_dir={out_dir}",
        f"hydra.run.dir={out_dir / 'hydra'}",
    ]


class EvalSbatchLauncher:
    """`launch.submit --eval`: launch.eval with the submitted overrides (the node composes them as this process
    did) as a one-node job on the core cell's resources, written beside the config as gyre-eval.sbatch."""

    def __init__(self, overrides: list[str]) -> None:
        self.overrides = overrides

    def render(self, plan: LaunchPlan) -> str:
        argv = eval_argv(plan.cfg, self.overrides, plan.out)
        return render_eval_sbatch(plan.cfg, argv, str(plan.log_dir))

    def launch(self, plan: LaunchPlan) -> int:
        script = plan.out / EVAL_SCRIPT
        script.write_text(self.render(plan))
        return sbatch(script)
