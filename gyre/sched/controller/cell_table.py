"""The controller's view of the cells, and its mailbox to them.

`CellTable` holds each cell's rank, role, engine and liveness. A cell counts as dead once its rank
process is gone (its liveness connection closed, gyre.sched.liveness; on this host also seen through
/proc) or it has owed an answer for longer than `sched.cell_timeout_s`. `Outbox` sends control
messages without waiting and matches the acks that come back, so micro-batch completions, role
switches and weight syncs can overlap. A cell's error is fatal unless the Outbox's `excuse` names a reason
it is not (a stop signal reached the cell's engine as well: gyre.sched.controller.orchestrator).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gyre.comm.control import ControlError, ControlPlane
from gyre.comm.messages import Ack, Role
from gyre.lifetime import pid_alive
from gyre.sched.liveness import LivenessWatch
from gyre.sched.policy import CellState


class CellDied(RuntimeError):
    def __init__(self, ranks: list[int]) -> None:
        super().__init__(f"ranks {ranks} died")
        self.ranks = ranks


@dataclass
class Cell:
    index: int
    rank: int
    role: Role = "rollout"
    alive: bool = True
    engine_url: str = ""
    engine_pid: int = -1
    pid: int = -1
    host: str = ""
    micro_batches: int = 0  # assigned so far (fault injection counts them)
    remote_followers: tuple[int, ...] = ()  # the cell's other ranks on other hosts than its leader's

    @property
    def local(self) -> bool:
        return self.host == socket.gethostname()


@dataclass
class CellTable:
    cells: list[Cell]
    liveness: LivenessWatch | None = None  # the leaders' connections: closed when a rank's process ends

    def alive(self) -> list[Cell]:
        return [c for c in self.cells if c.alive]

    def by_rank(self, rank: int) -> Cell:
        return next(c for c in self.cells if c.rank == rank)

    def serving(self) -> list[Cell]:
        return [c for c in self.cells if c.alive and c.role == "rollout"]

    def training(self) -> list[Cell]:
        return [c for c in self.cells if c.alive and c.role == "train"]

    def states(self, busy: Callable[[Cell], bool]) -> list[CellState]:
        return [CellState(c.index, c.role, busy(c), c.alive) for c in self.cells]

    def process_gone(self, cell: Cell) -> bool:
        """Its rank's process has ended: its liveness connection closed, or /proc says so on this host."""
        gone = self.liveness.gone() if self.liveness is not None else set()
        return cell.rank in gone or (cell.local and cell.pid > 0 and not pid_alive(cell.pid))

    def newly_dead(self) -> list[Cell]:
        """Living cells whose process is gone (a silent one that still runs dies by timeout)."""
        return [c for c in self.cells if c.alive and self.process_gone(c)]


@dataclass
class Outbox:
    cp: ControlPlane
    timeout_s: float
    waiting: dict[int, tuple[int, Any, float]] = field(default_factory=dict)  # seq -> (rank, body, sent)
    forgotten: set[int] = field(default_factory=set)  # ranks declared dead: a late ack from one is dropped
    # why a failed `body` is no error ("": it is one); an excused ack comes back with its error set
    excuse: Callable[[Any], str] = lambda body: ""

    def send(self, rank: int, body: Any) -> int:
        seq = self.cp.send(rank, body)
        self.waiting[seq] = (rank, body, time.monotonic())
        return seq

    def pump(self) -> list[tuple[Any, Ack]]:
        """Every ack that has arrived, with the message it answers."""
        got = []
        while (env := self.cp.recv(timeout=0)) is not None:
            ack = env.body
            if env.src in self.forgotten:
                continue
            if not isinstance(ack, Ack) or ack.seq not in self.waiting:
                raise ControlError(f"unexpected control message from rank {env.src}: {type(ack).__name__}")
            _, body, _ = self.waiting.pop(ack.seq)
            if ack.error:
                failed = f"{type(body).__name__} failed on rank {ack.rank}: {ack.error}"
                if not (why := self.excuse(body)):
                    raise ControlError(failed)
                print(f"gyre: {failed} ({why})", flush=True)
            got.append((body, ack))
        return got

    def overdue(self) -> list[int]:
        now = time.monotonic()
        return sorted({rank for rank, _, sent in self.waiting.values() if now - sent > self.timeout_s})

    def forget(self, rank: int) -> None:
        """A dead rank will answer nothing (one declared dead while running may still: that is ignored)."""
        self.forgotten.add(rank)
        self.waiting = {s: w for s, w in self.waiting.items() if w[0] != rank}

    def has_mail(self) -> bool:
        return self.cp.has_mail()

    def call(
        self,
        messages: dict[int, Any],
        on_other: Callable[[Any, Ack], None],
        check_dead: Callable[[], list[int]],
    ) -> dict[int, Ack]:
        """Send each rank its message and wait for all acks (an excused failure's with its error set); other acks
        go to `on_other` meanwhile."""
        seqs = {self.send(rank, body): rank for rank, body in messages.items()}
        acks: dict[int, Ack] = {}

        def poll() -> bool | None:
            for body, ack in self.pump():
                if ack.seq in seqs:
                    acks[seqs[ack.seq]] = ack
                else:
                    on_other(body, ack)
            if len(acks) == len(seqs):
                return True
            dead = [r for r in check_dead() if r in messages and r not in acks]
            if dead or (dead := [r for r in self.overdue() if r in messages and r not in acks]):
                raise CellDied(dead)
            return None

        self.cp.wait_for(poll, None)
        return acks


def ranks_of(cells: Iterable[Cell]) -> list[int]:
    return [c.rank for c in cells]


def kill_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
