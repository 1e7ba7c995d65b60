"""Streaming training's book of micro-batches: each one pending, assigned to a cell, or done there.

A micro-batch counts toward its step's update only once the cell that trained it delivers its
gradients at the step's reduction. A cell that dies before that loses everything it trained in the
step (its gradients die with it), so all of its assigned and done micro-batches of open steps go
back to pending and are trained again elsewhere: none lost, none counted twice.

Cells take work by progress: a training cell asks for the next micro-batch when it has room
(`micro_batches_in_flight`), so faster cells take more and all finish the step together; the
largest micro-batches go first, so the last ones handed out are the smallest.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from gyre.comm.messages import MicroBatchRef


@dataclass
class _Entry:
    step: int
    ref: MicroBatchRef
    state: str = "pending"  # pending | assigned | done
    cell: int = -1
    attempts: int = 0


class LedgerError(RuntimeError):
    """A micro-batch changed state in a way the protocol does not allow (a bug, not a fault)."""


class MicroBatchLedger:
    def __init__(self) -> None:
        self._entries: dict[tuple[str, int], _Entry] = {}
        self.reassigned = Counter[int]()  # step -> micro-batches handed out again after a cell died

    @staticmethod
    def _key(ref: MicroBatchRef) -> tuple[str, int]:
        return (ref.shard, ref.index)

    def add(self, step: int, refs: list[MicroBatchRef]) -> None:
        for ref in refs:
            if self._key(ref) in self._entries:
                raise LedgerError(f"micro-batch {ref.index} of {ref.shard} was added twice")
            self._entries[self._key(ref)] = _Entry(step, ref)

    def _of(self, step: int, state: str | None = None, cell: int | None = None) -> list[_Entry]:
        return [
            e
            for e in self._entries.values()
            if e.step == step and (state is None or e.state == state) and (cell is None or e.cell == cell)
        ]

    def take(self, step: int, cell: int) -> MicroBatchRef | None:
        """The largest pending micro-batch of `step`, now assigned to `cell`; None when none is pending."""
        pending = self._of(step, "pending")
        if not pending:
            return None
        entry = max(pending, key=lambda e: (e.ref.tokens, e.ref.shard, -e.ref.index))
        entry.state, entry.cell, entry.attempts = "assigned", cell, entry.attempts + 1
        return entry.ref

    def done(self, cell: int, ref: MicroBatchRef) -> None:
        entry = self._entries.get(self._key(ref))
        if entry is None or entry.state != "assigned" or entry.cell != cell:
            state = "unknown" if entry is None else f"{entry.state} on cell {entry.cell}"
            raise LedgerError(f"cell {cell} reported micro-batch {ref.index} of {ref.shard} done, but it is {state}")
        entry.state = "done"

    def fail_cell(self, cell: int) -> list[MicroBatchRef]:
        """A cell died: its assigned and done (not yet reduced) micro-batches go back to pending."""
        back = [e for e in self._entries.values() if e.cell == cell and e.state in ("assigned", "done")]
        for e in back:
            e.state, e.cell = "pending", -1
            self.reassigned[e.step] += 1
        return [e.ref for e in back]

    def pending(self, step: int) -> int:
        return len(self._of(step, "pending"))

    def open_work(self, step: int) -> int:
        """Micro-batches of `step` not yet done (pending or in flight)."""
        return len(self._of(step)) - len(self._of(step, "done"))

    def in_flight(self, cell: int) -> int:
        return sum(1 for e in self._entries.values() if e.cell == cell and e.state == "assigned")

    def contributors(self, step: int) -> dict[int, int]:
        """cell -> micro-batches of `step` it has done."""
        return dict(Counter(e.cell for e in self._of(step, "done")))

    def close_step(self, step: int) -> dict[int, int]:
        """The step is reduced: forget its micro-batches; returns contributors as `contributors` did."""
        if self.open_work(step):
            raise LedgerError(f"step {step} still has {self.open_work(step)} micro-batches not done")
        out = self.contributors(step)
        for key in [k for k, e in self._entries.items() if e.step == step]:
            del self._entries[key]
        return out

    def total(self, step: int) -> int:
        return len(self._of(step))


# The controller's streaming-training rules as functions of the ledger, so that the simulator
# (gyre.sim) runs the same rules on a simulated clock.


def hand_out(
    ledger: MicroBatchLedger, step: int, training: Sequence[int], depth: int
) -> list[tuple[int, MicroBatchRef]]:
    """Give each training cell the largest pending micro-batches of `step` until it holds `depth`:
    least-loaded first; on a tie satellites before the core, which also reduces and steps."""
    out = []
    for cell in sorted(training, key=lambda c: (ledger.in_flight(c), c == 0)):
        while ledger.in_flight(cell) < depth and (ref := ledger.take(step, cell)):
            out.append((cell, ref))
    return out


def waiting_work(ledger: MicroBatchLedger, step: int, all_groups_in: bool) -> int:
    """Work of `step` that no cell has taken: pending micro-batches, or (1) the optimizer update once
    every group is in and every micro-batch is done, which only the core can make."""
    if pending := ledger.pending(step):
        return pending
    return int(update_waits(ledger, step, all_groups_in))


def update_waits(ledger: MicroBatchLedger, step: int, all_groups_in: bool) -> bool:
    """The work `waiting_work` counts is the step's update: every group in, every micro-batch done."""
    return all_groups_in and ledger.open_work(step) == 0


def step_ready(ledger: MicroBatchLedger, step: int, all_groups_in: bool, core_trains: bool) -> bool:
    """The step can be reduced: all its groups are in, every micro-batch is done, and the core trains
    (its memory holds the optimizer step, not its engine)."""
    return all_groups_in and ledger.open_work(step) == 0 and core_trains
