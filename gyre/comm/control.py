"""The control plane: a controller and the cells it drives, exchanging `gyre.comm.messages`.

One `ControlPlane` over a `Mailbox` that moves envelopes: MPI for a job of cells (gyre.comm.mpi_control, a
controller on rank 0 and one communicator per cell), or in-process queues for one local cell run in a
thread beside the controller (gyre.comm.local_control), as submitit's debug executor sits beside its Slurm
one. Requests, acks, serving and waiting are the same code over either.

Waiting never spins the CPU: MPICH's blocking receive busy-polls (a quarter of a core measured on an idle
rank), so every wait here is a non-blocking probe followed by a pause that doubles up to `poll_max_s`
(about 0.5% of a core idle); the in-process mailbox ends a pause as soon as a message arrives.

Importing this module loads no MPI: `world_control_plane` imports mpi4py when a job of cells builds its plane.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from gyre.comm.messages import Ack, Envelope, Message, Role, RoleSwitch, Shutdown

CONTROL_TAG = 4242
ANY_SOURCE = None  # recv's `source` for a message from anyone
T = TypeVar("T")
Handler = Callable[[Any], Mapping[str, Any] | None]


class ControlError(RuntimeError):
    """A rank answered a control message with an error, or did not answer in time."""


@dataclass(frozen=True)
class CellLayout:
    """World ranks of each cell (cell 0 is the core); the controller rank belongs to no cell."""

    cells: tuple[tuple[int, ...], ...]
    controller: int = 0

    @classmethod
    def contiguous(cls, world_size: int, cell_sizes: Iterable[int]) -> CellLayout:
        """Rank 0 controls; ranks 1.. fill the cells in order."""
        sizes = list(cell_sizes)
        if not sizes or min(sizes) < 1 or sum(sizes) != world_size - 1:
            raise ValueError(
                f"cell sizes {sizes} must be positive and sum to world size - 1 = {world_size - 1} "
                f"(rank 0 is the controller); launch with mpirun -n {sum(sizes) + 1} or change the sizes"
            )
        starts = itertools.accumulate([1, *sizes[:-1]])
        return cls(tuple(tuple(range(s, s + n)) for s, n in zip(starts, sizes, strict=True)))

    @classmethod
    def from_places(cls, places: Sequence[tuple[int, int]]) -> CellLayout:
        """World rank i at `places[i]` = (cell, rank in the cell), cell -1 the controller (as each rank found
        its place from Slurm's variables: gyre.sched.launch.slurm_env.place_in_job)."""
        controllers = [r for r, (cell, _) in enumerate(places) if cell < 0]
        cells = sorted({cell for cell, _ in places if cell >= 0})
        if len(controllers) != 1 or cells != list(range(len(cells))):
            raise ValueError(f"places {list(places)}: expected one controller (cell -1) and cells 0..n-1")
        ranks = [
            sorted((i for i, (c, _) in enumerate(places) if c == cell), key=lambda i: places[i][1]) for cell in cells
        ]
        for cell, members in zip(cells, ranks, strict=True):
            if [places[i][1] for i in members] != list(range(len(members))):
                raise ValueError(f"cell {cell}'s ranks are at {[places[i][1] for i in members]}, not 0..n-1")
        return cls(tuple(tuple(m) for m in ranks), controllers[0])

    def cell_of(self, rank: int) -> int:
        """The cell of a world rank, -1 for the controller."""
        for i, ranks in enumerate(self.cells):
            if rank in ranks:
                return i
        if rank == self.controller:
            return -1
        raise ValueError(f"rank {rank} is in no cell of {self.cells} and is not the controller")

    def ranks(self, cell: int) -> tuple[int, ...]:
        return self.cells[cell]

    @property
    def leaders(self) -> tuple[int, ...]:
        """Each cell's first rank: the one the cell runtime's controller talks to (gyre.sched.cell.ranks)."""
        return tuple(ranks[0] for ranks in self.cells)

    @property
    def workers(self) -> tuple[int, ...]:
        return tuple(r for ranks in self.cells for r in ranks)


@dataclass(frozen=True)
class SwitchResult:
    cell: int
    role: Role
    latency_s: float  # controller send -> last ack received
    acks: tuple[Ack, ...]


class Mailbox(Protocol):
    """Moves envelopes between ranks without blocking (MPI, or queues in one process)."""

    rank: int
    comm: Any  # the MPI world communicator (None in one process): gradients and shards move over it
    cell_comm: Any  # this rank's cell: Get_rank, Get_size, bcast, gather, Ibarrier, Free (mpi4py's names)

    def post(self, dest: int, env: Envelope) -> None: ...

    def take(self, source: int | None) -> Envelope | None:
        """The next envelope (from `source`; None: from anyone) if one has arrived."""

    def has_mail(self) -> bool: ...

    def pause(self, seconds: float) -> None:
        """Wait up to `seconds` for something to arrive (a plain sleep where arrival cannot be seen)."""

    def flush(self) -> bool:
        """Whether every envelope posted has been delivered."""

    def free(self) -> None: ...


class ControlPlane:
    def __init__(
        self, mailbox: Mailbox, layout: CellLayout, poll_max_s: float = 0.02, poll_min_s: float = 2e-4
    ) -> None:
        self.mailbox = mailbox
        self.comm = mailbox.comm
        self.cell_comm = mailbox.cell_comm
        self.rank = mailbox.rank
        self.layout = layout
        self.cell = layout.cell_of(self.rank)
        self.poll_min_s, self.poll_max_s = poll_min_s, poll_max_s
        self._seq = itertools.count(1)
        self._inbox: deque[Envelope] = deque()

    @property
    def is_controller(self) -> bool:
        return self.rank == self.layout.controller

    # ----- waiting without spinning -----
    def wait_for(self, poll: Callable[[], T | None], timeout: float | None) -> T | None:
        """Call `poll` until it returns something, pausing between calls; None after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = self.poll_min_s
        while True:
            got = poll()
            if got is not None:
                return got
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.mailbox.pause(min(delay, left))
            else:
                self.mailbox.pause(delay)
            delay = min(delay * 2, self.poll_max_s)

    # ----- point to point -----
    def send(self, dest: int, body: Message, seq: int | None = None) -> int:
        """Send without blocking; returns the message's sequence number."""
        seq = next(self._seq) if seq is None else seq
        self.mailbox.post(dest, Envelope(seq, self.rank, body, time.time()))
        return seq

    def recv(self, timeout: float | None = None, source: int | None = ANY_SOURCE) -> Envelope | None:
        """The next message (from `source`), or None after `timeout` seconds (None: wait forever)."""
        for env in self._inbox:
            if source in (ANY_SOURCE, env.src):
                self._inbox.remove(env)
                return env
        return self.wait_for(lambda: self.mailbox.take(source), timeout)

    def has_mail(self) -> bool:
        return bool(self._inbox) or self.mailbox.has_mail()

    def reply(self, env: Envelope, detail: Mapping[str, Any] | None = None, error: str = "") -> None:
        self.send(env.src, Ack(env.seq, self.rank, self.cell, dict(detail or {}), error))

    # ----- controller side -----
    def request(self, ranks: Iterable[int], body: Message, timeout: float = 60.0) -> tuple[Ack, ...]:
        """Send `body` to each rank and wait for all their acks; other messages wait in the inbox."""
        ranks = tuple(ranks)
        seq = next(self._seq)
        for r in ranks:
            self.send(r, body, seq)
        acks: dict[int, Ack] = {}
        deadline = time.monotonic() + timeout

        def poll() -> bool | None:
            env = self.mailbox.take(ANY_SOURCE)
            if env is None:
                return None
            if isinstance(env.body, Ack) and env.body.seq == seq and env.src in ranks:
                acks[env.src] = env.body
                return True if len(acks) == len(ranks) else None
            self._inbox.append(env)
            return None

        while len(acks) < len(ranks):
            if self.wait_for(poll, deadline - time.monotonic()) is None:
                missing = sorted(set(ranks) - set(acks))
                raise ControlError(f"no ack for {type(body).__name__} from ranks {missing} within {timeout} s")
        if errors := [f"rank {a.rank}: {a.error}" for a in acks.values() if a.error]:
            raise ControlError(f"{type(body).__name__} failed on " + "; ".join(errors))
        return tuple(acks[r] for r in ranks)

    def switch_role(self, cell: int, role: Role, timeout: float = 60.0) -> SwitchResult:
        start = time.monotonic()
        acks = self.request(self.layout.ranks(cell), RoleSwitch(cell, role), timeout)
        return SwitchResult(cell, role, time.monotonic() - start, acks)

    def shutdown(self, reason: str = "", timeout: float = 60.0) -> None:
        self.request(self.layout.workers, Shutdown(reason), timeout)

    # ----- worker side -----
    def serve(self, handlers: Mapping[type, Handler], timeout: float | None = None) -> None:
        """Answer controller messages until Shutdown: each goes to the handler for its type, whose
        returned mapping becomes the ack's detail; an exception becomes the ack's error."""
        while True:
            env = self.recv(timeout, source=self.layout.controller)
            if env is None:
                raise ControlError(f"rank {self.rank}: no control message within {timeout} s")
            handler = handlers.get(type(env.body))
            try:
                if handler is None and not isinstance(env.body, Shutdown):
                    raise ControlError(f"rank {self.rank} has no handler for {type(env.body).__name__}")
                detail = handler(env.body) if handler is not None else None
            except Exception as e:  # noqa: BLE001 - reported to the controller in the ack
                self.reply(env, error=f"{type(e).__name__}: {e}")
            else:
                self.reply(env, detail)
            if isinstance(env.body, Shutdown):
                return

    def cell_barrier(self, timeout: float | None = None) -> None:
        """All ranks of this rank's cell meet here (Ibarrier, tested with backoff)."""
        req = self.cell_comm.Ibarrier()
        if self.wait_for(lambda: True if req.Test() else None, timeout) is None:
            req.Cancel()
            raise ControlError(f"cell {self.cell} barrier not reached by all ranks within {timeout} s")

    def close(self, timeout: float = 10.0) -> None:
        """Wait for outgoing messages to be delivered, then free the cell communicator."""
        if self.wait_for(lambda: True if self.mailbox.flush() else None, timeout) is None:
            raise ControlError(f"rank {self.rank}: control messages undelivered after {timeout} s")
        self.mailbox.free()


def world_control_plane(
    cell_sizes: Iterable[int], poll_max_s: float = 0.02, layout: CellLayout | None = None
) -> ControlPlane:
    """The control plane over MPI_COMM_WORLD: `layout`, or rank 0 the controller and the cells in rank order.
    Collective: every rank of the job builds it (splitting the cell communicators)."""
    from gyre.comm.mpi_control import MpiMailbox, world

    comm = world()
    layout = layout or CellLayout.contiguous(comm.Get_size(), cell_sizes)
    return ControlPlane(MpiMailbox(comm, layout), layout, poll_max_s)
