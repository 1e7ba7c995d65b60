"""A run of one local cell in one process: the controller on the main thread (it owns the signals), the cell
in a thread beside it, queues between them (gyre.comm.local_control). What `scheduler=colocate` runs on one
cell of one rank, without mpirun; every other layout runs as an MPI job of cells (gyre.sched.launch.local).
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

from gyre.comm.local_control import CELL_RANK, fail_cell, local_control_planes
from gyre.comm.messages import Shutdown
from gyre.config.schema import RunConfig
from gyre.config.validate import cell_ranks
from gyre.sandbox.limits import raise_open_file_limit
from gyre.sched.runtime import POLICY_FILE, RunStart, run_cell, run_controller

CELL_STOP_S = 60.0  # how long the cell may take to stop its engine once told to


def runs_in_process(cfg: RunConfig) -> bool:
    """One cell of one rank that switches as a whole: nothing to launch."""
    return cfg.scheduler == "colocate" and cell_ranks(cfg) == [1]


def run_in_process(cfg: RunConfig, out: Path, point: Any = None) -> None:
    """The controller here, the cell in a thread; raises what either raised (Preempted after a stop signal,
    once checkpointed). `point` (a ResumePoint): start there instead of at the run's own checkpoint."""
    raise_open_file_limit()  # before anything opens: no rollout's connections may exhaust the trainer's
    controller_plane, cell_plane = local_control_planes(cfg.comm.idle_poll_max_s)
    start = RunStart(cfg, out, uuid.uuid4().hex, in_process=True)
    (out / POLICY_FILE).unlink(missing_ok=True)

    def cell() -> None:
        try:
            run_cell(start, cell_plane)
        except BaseException as e:  # the controller raises it
            fail_cell(cell_plane, e)

    thread = threading.Thread(target=cell, name="gyre-cell0", daemon=True)
    thread.start()
    try:
        run_controller(start, controller_plane, point)
    finally:
        if thread.is_alive():  # told already after a finished run; after a failure, told here
            controller_plane.send(CELL_RANK, Shutdown("the controller stopped", finalize=False))
        thread.join(CELL_STOP_S)
