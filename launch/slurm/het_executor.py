"""submitit for heterogeneous jobs: one submission = one het job whose step runs the pickled function
on every task, so users keep submitit's Job handles, logs and results.

submitit itself has no het-job support; this builds on its folder and pickle machinery:
- the sbatch text is our generated het script, with submitit's `_submit` command as the argv of
  the cell job's step (launch/slurm/plan.py; each task's result is
  `<leader id>_<SLURM_PROCID>_result.pkl`, which is what submitit's JobEnvironment names it, since
  SLURM_JOB_ID is the leader's id in every component);
- the folder must not contain `%j`: component k would expand it to its own id;
- job state comes from `scontrol` (or sacct's `<id>+<offset>` rows), since submitit's sacct
  parsing skips het-job rows and without accounting reports UNKNOWN forever, so a job that died
  before writing a result would never count as done.
"""

from __future__ import annotations

import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

import submitit
from submitit.core import core, utils
from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob

from gyre.config.schema import RunConfig
from launch.slurm.plan import Step, cells, cluster_python, plan_step
from launch.slurm.preflight import parse_records, parse_time_s
from launch.slurm.sbatch import ScriptLayout, render_sbatch

ACTIVE = ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED", "RESIZING", "SUSPENDED", "PREEMPTED")


def het_job_state(job_id: str) -> str:
    """One state for a het job: an active component's state if any, else the first non-COMPLETED one."""
    proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    states = [rec.get("JobState", "UNKNOWN") for rec in parse_records(proc.stdout)] if proc.returncode == 0 else []
    if not states:  # purged from slurmctld (MinJobAge): ask accounting, if there is any
        proc = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id], capture_output=True, text=True, timeout=30
        )
        states = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()] if proc.returncode == 0 else []
    if not states:
        return "NOT_FOUND"  # gone from Slurm: done, and results() will say whether it left a result
    active = [s for s in states if s in ACTIVE]
    failed = [s for s in states if s != "COMPLETED"]
    return (active or failed or states)[0]


class HetJobWatcher(SlurmInfoWatcher):
    def update(self) -> None:
        pending = sorted(self._registered - self._finished)
        if not pending:
            return
        self._num_calls += 1
        for job_id in pending:
            self._info_dict[job_id] = {"State": het_job_state(job_id)}
        self._last_status_check = time.time()
        for job_id in pending:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)


class HetSlurmJob(SlurmJob[Any]):
    watcher = HetJobWatcher(delay_s=60)


def _submitit_log_names(step: Step) -> tuple[str, str | None]:
    """submitit's own names, so job.stdout()/stderr() find them."""
    return "${SLURM_JOB_ID}_${SLURM_PROCID}_log.out", "${SLURM_JOB_ID}_${SLURM_PROCID}_log.err"


class HetSlurmExecutor(submitit.SlurmExecutor):
    """`executor.submit(fn, ...)` runs fn on every task of the het job's step, one MPI world.

    `job.results()` holds one result per task (task i = SLURM_PROCID i; task 0 is the controller,
    task 1 the core cell, both on component 0; task 1+i satellite cell i). For the cell job, fn is
    `gyre.sched.launch.job.submitit_main`, with `start_guard=True`: the script reruns a start whose MPI world
    never comes up (launch/slurm/sbatch.py); any other fn runs once, however long it takes.
    """

    job_class = HetSlurmJob

    def __init__(self, folder: str | Path, cfg: RunConfig, config_path: str = "", start_guard: bool = False) -> None:
        if "%" in str(folder):
            raise ValueError(
                f"folder {folder!r} has a % pattern: in a het job each component would expand %j to its own id; "
                "use a plain folder (one per run)"
            )
        super().__init__(folder, python=shlex.quote(cluster_python(cfg)))
        self.cfg = cfg
        self.config_path = config_path
        self.start_guard = start_guard  # fn is the cell job (gyre.sched.launch.job.submitit_main): guard its MPI start
        self.step = plan_step(cfg, ["(submitit)"])  # fails early on a bad layout
        minutes = max((parse_time_s(c.time) or 0) for c in cells(cfg)) // 60
        self.update_parameters(time=minutes or 60)  # submitit's timeout bookkeeping; not written to sbatch

    def _internal_process_submissions(self, delayed_submissions: list[utils.DelayedSubmission]) -> list[core.Job[Any]]:
        if len(delayed_submissions) != 1:
            raise NotImplementedError("one het job per submission: map_array/batch are not supported here")
        return core.PicklingExecutor._internal_process_submissions(self, delayed_submissions)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        layout = ScriptLayout(
            log_dir=str(self.folder),
            config_path=self.config_path or "(in the pickled submission)",
            batch_output="%j_batch.out",
            batch_error="%j_batch.err",
            log_names=_submitit_log_names,
            exports=(("SUBMITIT_EXECUTOR", "slurm"),),
            start_guard=self.start_guard,
            stale_on_restart=('"$GYRE_LOG_DIR/${SLURM_JOB_ID}"_*_result.pkl',),  # a failed start's error results
        )
        return render_sbatch(self.cfg, plan_step(self.cfg, shlex.split(command)), layout)

    def _num_tasks(self) -> int:
        return self.step.num_tasks
