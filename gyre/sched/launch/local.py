"""Starting a run on this machine: the run directory, then its cells, in this process or under `mpirun`.

`local_plan(cfg)` writes RUN_DIR/config.yaml; `local_launcher(cfg)` then runs one local cell of one rank
(scheduler=colocate) in this process (gyre.sched.launch.in_process), and any other layout as an MPI job: it
re-executes under the venv's `mpirun -n 1+C` (gyre.sched.launch.job; its rank 0 builds or reuses the warm start
while the cells start up). Each rank runs inside `sh -c` with
SIGUSR1 ignored and mpiexec's auto-cleanup off, so that a killed cell rank leaves the others running
(MPICH otherwise tears the whole job down); the controller then carries on without it.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

import gyre
from gyre.config.domain import fail
from gyre.config.schema import RunConfig, Scheduler
from gyre.config.validate import cell_ranks, check_cells
from gyre.errors import UserError
from gyre.resume.preemption import PREEMPTED_EXIT_CODE, Preempted
from gyre.sched.launch.launcher import Launcher, LaunchPlan
from gyre.sched.launch.mpich_leftovers import remove_leftovers, wait_until_gone
from gyre.sched.runtime import POLICY_FILE

CONTROLLER_PID_FILE = "controller.pid"  # rank 0's pid, for passing stop signals on
DEAD_CELLS_EXIT_CODE = 3  # rank 0's exit when the run lost cells and sched.allow_dead_cells is not set
RANK_SHELL = 'trap "" USR1; "$0" -m mpi4py -m gyre.sched.launch.job "$1"; exit $?'
# a rank that stops on an expected failure (gyre.errors.UserError) writes "<exit code>\n<message>" here; the
# first one wins, so the user reads the message once however many ranks fail alike (gyre.sched.launch.job.fail_rank)
RANK_ERROR_FILE = "rank_error.txt"
LAUNCHER_REPORTS_ENV = "GYRE_LAUNCHER_REPORTS"  # set by MpirunLauncher: it prints that message, the ranks stay quiet


class DeadCellsError(UserError, RuntimeError):
    """The run finished without some of its cells (sched.allow_dead_cells is not set)."""

    exit_code = DEAD_CELLS_EXIT_CODE


class CellJobError(UserError):
    """A rank of the cell job stopped it with an expected failure; the message is that rank's."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def read_rank_error(out: Path) -> CellJobError | None:
    try:
        code, _, message = (out / RANK_ERROR_FILE).read_text().partition("\n")
    except FileNotFoundError:
        return None
    return CellJobError(message, int(code) if code.isdigit() else 1)


def mpirun_command(cfg: RunConfig, out: Path) -> list[str]:
    mpirun = cfg.sched.mpirun or str(Path(sys.executable).parent / "mpirun")
    if not Path(mpirun).exists():
        fail("sched.mpirun", mpirun, "not found: `pip install mpi4py mpich` into this venv or set sched.mpirun")
    ranks = 1 + sum(cell_ranks(cfg))  # the controller, then each cell's ranks
    return [mpirun, "-disable-auto-cleanup", "-n", str(ranks), "sh", "-c", RANK_SHELL, sys.executable, str(out)]


def run_forwarding_stops(argv: list[str], env: dict[str, str], controller_pid: Path) -> int:
    """Run mpirun; a SIGTERM/SIGUSR1 to this process goes to the controller (rank 0) as SIGUSR2, which
    checkpoints and stops the job (exit 75), rather than to mpiexec, which would tear it down."""
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)

    def forward(signum: int, frame: object) -> None:
        try:
            os.kill(int(controller_pid.read_text()), signal.SIGUSR2)
        except (FileNotFoundError, ValueError, ProcessLookupError):  # not started yet: nothing to save
            proc.terminate()

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def check_supported(cfg: RunConfig) -> None:
    """Fail before any work for settings no configuration can run yet, rather than silently ignoring them."""
    supported = {"scheduler": tuple(Scheduler), "train.backend": ("megatron",), "rl.algorithm": ("gspo",)}
    values = {"scheduler": cfg.scheduler, "train.backend": cfg.train.backend, "rl.algorithm": cfg.rl.algorithm}
    for key, value in values.items():
        if value not in supported[key]:
            raise ValueError(f"{key}={value!r} is not available yet; supported: {', '.join(supported[key])}")


def local_plan(cfg: RunConfig) -> LaunchPlan:
    """The run directory, with the resolved config in it, for a run on this machine."""
    check_supported(cfg)
    if cfg.scheduler == "colocate":  # the core cell alone switches (colocate_cells switches satellites with it)
        cfg.cluster.satellites = []
    check_cells(cfg)
    out = Path(cfg.output_dir or f"outputs/{time.strftime('%Y-%m-%d_%H-%M-%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg.output_dir = str(out)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return LaunchPlan(cfg, out, out / "config.yaml", out)


def local_launcher(cfg: RunConfig) -> Launcher:
    """In this process for one local cell of one rank that switches as a whole; mpirun for any other layout."""
    from gyre.sched.launch.in_process import runs_in_process

    return InProcessLauncher() if runs_in_process(cfg) else MpirunLauncher()


class InProcessLauncher:
    """The controller on this process's main thread, the one cell in a thread beside it (gyre.sched.launch.in_process)."""

    def render(self, plan: LaunchPlan) -> str:
        return f"in this process (pid {os.getpid()}): the controller and cell 0 of {plan.out}"

    def launch(self, plan: LaunchPlan) -> int:
        from gyre.sched.launch.in_process import run_in_process

        run_in_process(plan.cfg, plan.out)
        return 0


class MpirunLauncher:
    """The cells as an MPI job on this machine (gyre.sched.launch.job on every rank)."""

    def render(self, plan: LaunchPlan) -> str:
        return shlex.join(mpirun_command(plan.cfg, plan.out))

    def launch(self, plan: LaunchPlan) -> int:
        run_mpi_job(plan.cfg, plan.out)
        return 0


def run_mpi_job(cfg: RunConfig, out: Path) -> None:
    """The cells under `mpirun` on this machine; stop signals to this process reach the controller."""
    root = str(Path(gyre.__file__).resolve().parent.parent)
    env = {**os.environ, "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR")}
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = str(cfg.sched.threads_per_cell)
    # shards are immutable once renamed into place, and cells read them while the controller reads and writes
    # others: HDF5's advisory locks only add spurious "unable to lock file" (EAGAIN) failures between ranks
    env.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")
    env[LAUNCHER_REPORTS_ENV] = "1"
    (out / POLICY_FILE).unlink(missing_ok=True)
    (out / RANK_ERROR_FILE).unlink(missing_ok=True)
    (out / CONTROLLER_PID_FILE).unlink(missing_ok=True)
    started = time.time()
    rc = run_forwarding_stops(mpirun_command(cfg, out), env, out / CONTROLLER_PID_FILE)
    if rc != 0:
        wait_until_gone(b"gyre.sched.launch.job\0" + str(out).encode() + b"\0")  # this job's ranks
        remove_leftovers(started)  # what MPICH leaves after MPI_Abort or a kill
    if rc == PREEMPTED_EXIT_CODE:  # stopped by a signal and checkpointed: the same command resumes
        raise Preempted("a stop signal")
    summary = out / "summary.json"
    if rc != 0 and (error := read_rank_error(out)):
        raise error
    if rc != 0:
        dead = json.loads(summary.read_text()).get("dead_cells") if summary.exists() else None
        if not dead:
            raise RuntimeError(f"the cell job failed (mpirun exit code {rc}); see the output above and {out}")
        if not cfg.sched.allow_dead_cells:
            raise DeadCellsError(
                f"cells {dead} died during the run (summary.json: dead_cell_reasons); it finished without them "
                f"(mpirun exit code {rc}). Set sched.allow_dead_cells=true to accept that"
            )
        print(f"gyre: cells {dead} died during the run; it finished without them (mpirun exit code {rc})")
