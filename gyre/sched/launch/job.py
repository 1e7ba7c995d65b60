"""The cell job's MPI program: `mpirun -n 1+C python -m mpi4py -m gyre.sched.launch.job RUN_DIR`.

Rank 0 runs the controller (gyre.sched.controller.orchestrator), ranks 1..C the cells (gyre.sched.cell.worker), all from
RUN_DIR/config.yaml. Started by gyre.sched.launch.local on one machine, or by `srun` over the components
of a Slurm het job (launch/submit.py; `submitit_main` under submitit). `-m mpi4py` turns an exception
on any rank into MPI_Abort of the job instead of a hang.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import traceback
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from mpi4py import MPI
from omegaconf import OmegaConf

from gyre.comm.control import CellLayout, world_control_plane
from gyre.config.load import to_run_config
from gyre.config.schema import RunConfig
from gyre.config.validate import cell_ranks, check_cells
from gyre.engine.admin_key import set_run_admin_key, take_run_admin_key
from gyre.errors import UserError, report, wants_traceback
from gyre.fsutil import remove_temporary_dirs
from gyre.resume.preemption import PREEMPTED_EXIT_CODE, Preempted
from gyre.sandbox.limits import raise_open_file_limit
from gyre.sched.controller.faults import stalls_start
from gyre.sched.launch.affinity import available_cpus, cpu_plan, pin
from gyre.sched.launch.job_preflight import run_preflight
from gyre.sched.launch.local import (
    CONTROLLER_PID_FILE,
    DEAD_CELLS_EXIT_CODE,
    LAUNCHER_REPORTS_ENV,
    RANK_ERROR_FILE,
    DeadCellsError,
)
from gyre.sched.launch.slurm_env import (
    WORLD_UP_VAR,
    CellPlace,
    cell_rank_from_env,
    mark_world_up,
    place_in_job,
    record_exit_status,
    start_attempt,
)
from gyre.sched.runtime import RunStart, run_cell, run_controller
from gyre.tracking import remove_wandb_temporary_dirs, without_wandb


def run(out: Path) -> tuple[bool, dict[str, Any], int]:
    """This rank's part of the job; returns (whether to MPI_Finalize, what this rank reports: the run's
    summary on rank 0, the cell index on the others; the exit code: PREEMPTED_EXIT_CODE on rank 0 after
    a stop signal, once the run is checkpointed and the cells are shut down; DEAD_CELLS_EXIT_CODE when it lost
    cells and sched.allow_dead_cells is not set). Rank 0's code is the job's: recorded for the Slurm script."""
    # mpiexec's -disable-auto-cleanup tells the survivors of a dead rank with SIGUSR1, whose default kills
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    cfg = to_run_config(OmegaConf.load(out / "config.yaml"))
    check_cells(cfg)
    raise_open_file_limit()  # before anything opens: no rollout's connections may exhaust the cell's
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    sizes = cell_ranks(cfg)
    layout = job_layout(world, cfg, os.environ)
    if rank != layout.controller or "wandb" not in cfg.logger:
        without_wandb()  # before preflight: only the controller's tracker may import it
    threads = cfg.sched.threads_per_cell
    if "SLURM_STEP_ID" in os.environ and not cfg.sched.cpu_sets:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # keep the CPUs Slurm bound this task to
    else:
        pin(cpu_plan(world.Get_size(), available_cpus(), cfg.sched.cpu_sets)[rank], threads)
    if rank > 0 and WORLD_UP_VAR in os.environ and stalls_start(cfg.sched.faults, rank - 1, start_attempt(os.environ)):
        threading.Event().wait()  # an injected stall: the start-up guard of the Slurm script ends this start
    start_id = world.bcast(uuid.uuid4().hex if rank == 0 else None, root=0)  # names this start's policy.json
    set_run_admin_key(world.bcast(take_run_admin_key() if rank == 0 else None, root=0))  # engines' admin routes
    cp = world_control_plane(sizes, cfg.comm.idle_poll_max_s, layout)  # collective: every rank has joined
    if rank == 0:
        mark_world_up(os.environ)
    # resolved once, here on this rank's node; engines, Mooncake and gloo use this address from now on
    place = (cp.cell, cp.cell_comm.Get_rank() if cp.cell >= 0 else 0)
    cfg.comm.hostname = run_preflight(world, cfg, out, start_id, place)
    if cfg.comm.transfer_backend == "gloo":
        from gyre.comm.gloo_transport import init_gloo_from_mpi

        init_gloo_from_mpi(world, cfg.comm.hostname)
    code = 0
    if cp.is_controller:
        (out / CONTROLLER_PID_FILE).write_text(str(os.getpid()))  # gyre.sched.launch.local passes stop signals here
        try:
            finalize = run_controller(RunStart(cfg, out, start_id), cp)
        except Preempted:
            finalize, code = True, PREEMPTED_EXIT_CODE
        report = json.loads((out / "summary.json").read_text())
        if report.get("dead_cells") and not cfg.sched.allow_dead_cells and code == 0:
            print(f"gyre: {dead_cells_message(report)}", file=sys.stderr, flush=True)
            code = DEAD_CELLS_EXIT_CODE
    else:
        for sig in (signal.SIGTERM, signal.SIGUSR2):  # they reach every rank: the controller stops the cells
            signal.signal(sig, signal.SIG_IGN)
        finalize, report = run_cell(RunStart(cfg, out, start_id), cp), {"cell": cp.cell}
    if finalize:
        cp.close()
    if cp.is_controller:
        record_exit_status(os.environ, code)
    return finalize, report, code


def dead_cells_message(summary: dict[str, Any]) -> str:
    reasons = summary.get("dead_cell_reasons", {})
    cells = "; ".join(f"cell {c}: {reasons.get(str(c), 'dead')}" for c in summary["dead_cells"])
    return (
        f"the run finished without cells {summary['dead_cells']} ({cells}); exit {DEAD_CELLS_EXIT_CODE}. "
        "Set sched.allow_dead_cells=true to accept a run that lost cells"
    )


def job_layout(world: Any, cfg: RunConfig, env: Mapping[str, str]) -> CellLayout:
    """Which world ranks form each cell. The job has a rank for the controller, then each cell's ranks (nodes
    x tasks_per_node). Under a Slurm het job every rank finds its cell, its rank in it and its node among the
    cell's nodes from Slurm's variables (gyre.sched.launch.slurm_env.place_in_job: the controller and the core's
    ranks on component 0, cell i's on component i, `tasks_per_node` of them on each of the cell's nodes), and
    the layout is what they found; elsewhere (mpirun) the cells take the ranks after the controller in order.
    Collective (an allgather under Slurm): every rank raises the same error."""
    size, sizes = world.Get_size(), cell_ranks(cfg)
    if size != 1 + sum(sizes):
        raise RuntimeError(
            f"the cell job has {size} ranks but the config's cells have {sizes} ranks: it needs "
            f"{1 + sum(sizes)} (the controller, then each cell's: cluster.core and each of cluster.satellites)"
        )
    if "SLURM_HET_SIZE" not in env or "SLURM_PROCID" not in env:
        return CellLayout.contiguous(size, sizes)
    tasks_per_node = [c.tasks_per_node for c in (cfg.cluster.core, *cfg.cluster.satellites)]
    try:
        place: CellPlace | str = place_in_job(cell_rank_from_env(env), tasks_per_node)
    except ValueError as e:
        place = f"rank {world.Get_rank()} on {env.get('SLURMD_NODENAME', '?')}: {e}"
    places = world.allgather(place)
    if errors := [p for p in places if isinstance(p, str)]:
        raise RuntimeError("the cell job's ranks are not where the config puts them:\n" + "\n".join(errors))
    layout = CellLayout.from_places([(p.cell, p.rank) for p in places])
    if [len(r) for r in layout.cells] != sizes:
        raise RuntimeError(
            f"Slurm's step holds cells of {[len(r) for r in layout.cells]} ranks, the config {sizes}: start the job "
            "with the generated sbatch script (launch/submit.py), which lays the ranks out by component"
        )
    return layout


def leave(finalize: bool, code: int = 0) -> NoReturn:
    """Leave without the interpreter's teardown (over 10 s with megatron loaded on a busy machine) and,
    once a rank died, without MPI_Finalize, which would wait for it forever (all of us skip it)."""
    if finalize:
        MPI.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    exit_now(code)


def exit_now(code: int) -> NoReturn:
    """os._exit, after the atexit work a rank must not skip (`remove_what_os_exit_skips`)."""
    remove_what_os_exit_skips()
    os._exit(code)


def remove_what_os_exit_skips() -> None:
    """The temporary directories atexit hooks would have removed: wandb's, and gyre's own that threads still in
    a session or a grading hold."""
    remove_wandb_temporary_dirs()
    remove_temporary_dirs()


def main(out: Path) -> None:
    try:
        finalize, _, code = run(out)
    except UserError as e:
        if wants_traceback():
            traceback.print_exc()
        fail_rank(out, e)
    leave(finalize, code)


def record_rank_error(out: Path, error: UserError) -> bool:
    """Write this rank's message to RUN_DIR/rank_error.txt unless another rank's is there; True if first."""
    tmp = out / f".{RANK_ERROR_FILE}.{os.getpid()}"
    try:
        tmp.write_text(f"{error.exit_code}\n{error}")
        os.link(tmp, out / RANK_ERROR_FILE)  # atomic, and fails when the file exists (on NFS too)
        return True
    except FileExistsError:
        return False
    except OSError:  # the run directory is not writable here: say it on this rank
        return True
    finally:
        tmp.unlink(missing_ok=True)


def fail_rank(out: Path, error: UserError) -> NoReturn:
    """Stop the whole job on an expected failure with its message said once: by gyre.sched.launch.local when it
    started the job (it reads rank_error.txt), else (srun) by the first rank that failed."""
    first = record_rank_error(out, error)
    if os.environ.get(LAUNCHER_REPORTS_ENV) == "1":
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # MPI_Abort's own line: the launcher says what happened
    elif first:
        report(error)
    sys.stdout.flush()
    remove_what_os_exit_skips()  # Abort ends this process as os._exit would: no atexit hooks
    MPI.COMM_WORLD.Abort(error.exit_code)
    os._exit(error.exit_code)  # not reached: Abort ends every rank


def submitit_main(run_dir: str, abort_after_s: float = 30.0) -> dict[str, Any]:
    """What each task of the cell job runs under submitit: submitit pickles the return value (rank 0:
    the run's summary) or the exception; a failed rank then aborts the job, as `-m mpi4py` would."""
    try:
        finalize, report, code = run(Path(run_dir))
    except BaseException:
        threading.Timer(abort_after_s, MPI.COMM_WORLD.Abort, args=(1,)).start()
        raise
    if finalize:
        MPI.Finalize()
    if code == DEAD_CELLS_EXIT_CODE:  # submitit's result is this error; the task exits non-zero
        raise DeadCellsError(dead_cells_message(report))
    # after submitit has written the result: skip the slow teardown; exit 75 when stopped (the script requeues)
    atexit.register(exit_now, code)  # before the hooks registered earlier (wandb's): atexit runs the last first
    return report


if __name__ == "__main__":
    main(Path(sys.argv[1]))
