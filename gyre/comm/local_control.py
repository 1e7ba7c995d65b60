"""The control plane in one process: the controller and one local cell, each in its own thread, exchanging
envelopes through queues (what an MPI job of one cell exchanges through MPI, without mpirun).

`local_control_planes()` returns the two ends: the controller's (rank 0) and the cell's (rank 1, cell 0,
the core). A pause ends as soon as an envelope arrives, so a round trip costs no polling delay. A cell
thread that fails says so (`fail`): the controller's next look for mail raises the cell's error, at once
rather than after sched.cell_timeout_s.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from gyre.comm.control import CellLayout, ControlPlane
from gyre.comm.messages import Envelope

CONTROLLER_RANK, CELL_RANK = 0, 1


class SoloComm:
    """A cell of one rank, with the few communicator calls the cell runtime makes on its cell's."""

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return 0

    def Get_size(self) -> int:  # noqa: N802
        return 1

    def bcast(self, value: Any, root: int = 0) -> Any:
        return value

    def gather(self, value: Any, root: int = 0) -> list[Any]:
        return [value]

    def Free(self) -> None:  # noqa: N802
        pass


class _Queues:
    """Each rank's incoming envelopes, and one condition every arrival notifies."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.incoming: dict[int, deque[Envelope]] = {r: deque() for r in ranks}
        self.arrived = threading.Condition()
        self.failure: BaseException | None = None  # the cell thread's error

    def fail(self, error: BaseException) -> None:
        with self.arrived:
            self.failure = error
            self.arrived.notify_all()


class LocalMailbox:
    comm = None

    def __init__(self, rank: int, queues: _Queues) -> None:
        self.rank = rank
        self.cell_comm = SoloComm()
        self._queues = queues
        self._mine = queues.incoming[rank]

    def post(self, dest: int, env: Envelope) -> None:
        with self._queues.arrived:
            self._queues.incoming[dest].append(env)
            self._queues.arrived.notify_all()

    def take(self, source: int | None) -> Envelope | None:
        with self._queues.arrived:
            for env in self._mine:
                if source is None or env.src == source:
                    self._mine.remove(env)
                    return env
            failure = self._queues.failure
        if failure is not None and self.rank == CONTROLLER_RANK:
            raise failure
        return None

    def has_mail(self) -> bool:
        return bool(self._mine)

    def fail(self, error: BaseException) -> None:
        self._queues.fail(error)

    def pause(self, seconds: float) -> None:
        with self._queues.arrived:
            if not self._mine and self._queues.failure is None:
                self._queues.arrived.wait(seconds)

    def flush(self) -> bool:
        return True

    def free(self) -> None:
        pass


def local_control_planes(poll_max_s: float = 0.02) -> tuple[ControlPlane, ControlPlane]:
    """(the controller's plane, the one local cell's plane) of a run in one process; the cell thread reports
    its failure with `fail_cell(cell_plane, error)`."""
    layout = CellLayout(((CELL_RANK,),), CONTROLLER_RANK)
    queues = _Queues((CONTROLLER_RANK, CELL_RANK))
    return (
        ControlPlane(LocalMailbox(CONTROLLER_RANK, queues), layout, poll_max_s),
        ControlPlane(LocalMailbox(CELL_RANK, queues), layout, poll_max_s),
    )


def fail_cell(cell_plane: ControlPlane, error: BaseException) -> None:
    """The cell thread ended on `error`: the controller raises it on its next look for mail."""
    mailbox = cell_plane.mailbox
    if not isinstance(mailbox, LocalMailbox):
        raise TypeError(f"fail_cell is for a cell in the controller's process, not one over {type(mailbox).__name__}")
    mailbox.fail(error)
