"""The control plane's MPI mailbox: envelopes pickled by mpi4py on one tag, one communicator per cell.

All ranks of the job build their mailbox together: splitting the cell communicators is a collective over
the world.
"""

from __future__ import annotations

import time
from typing import Any

from mpi4py import MPI

from gyre.comm.control import CONTROL_TAG, CellLayout
from gyre.comm.messages import Envelope


def world() -> Any:
    return MPI.COMM_WORLD


class MpiMailbox:
    def __init__(self, comm: MPI.Comm, layout: CellLayout) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        cell = layout.cell_of(self.rank)
        color = cell if cell >= 0 else MPI.UNDEFINED
        key = layout.ranks(cell).index(self.rank) if cell >= 0 else 0  # its rank in the cell
        self.cell_comm: MPI.Comm = comm.Split(color, key=key)
        self._sends: list[MPI.Request] = []

    def post(self, dest: int, env: Envelope) -> None:
        self._sends = [r for r in self._sends if not r.Test()]
        self._sends.append(self.comm.isend(env, dest=dest, tag=CONTROL_TAG))

    def take(self, source: int | None) -> Envelope | None:
        msg = self.comm.improbe(source=MPI.ANY_SOURCE if source is None else source, tag=CONTROL_TAG)
        return None if msg is None else msg.recv()

    def has_mail(self) -> bool:
        return bool(self.comm.Iprobe(tag=CONTROL_TAG))

    def pause(self, seconds: float) -> None:
        time.sleep(seconds)

    def flush(self) -> bool:
        if not MPI.Request.Testall(self._sends):
            return False
        self._sends = []
        return True

    def free(self) -> None:
        if self.cell_comm != MPI.COMM_NULL:
            self.cell_comm.Free()
