"""The controller's side of streaming training: hand out micro-batches, close steps, sync weights.

Only micro-batches of the step the current weights train (step == version) are handed out; each
training cell gets the next one whenever it has room, so faster cells take more. A step closes when
all its groups are in and every micro-batch is done: the contributors send their gradients to the
core, which steps and publishes version + 1; every living cell then pulls it (training replicas and
rollout engines alike), and the next step's micro-batches may go out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gyre.comm.messages import Ack, GradientReduce, MicroBatchAssignment, WeightVersion
from gyre.sched.controller.cell_table import Cell, CellDied
from gyre.sched.controller.context import ControllerContext
from gyre.sched.controller.faults import FaultInjector
from gyre.sched.controller.steps import StepBook
from gyre.sched.policy.ledger import MicroBatchLedger, hand_out, step_ready, update_waits, waiting_work


class TrainPlane:
    def __init__(
        self,
        ctx: ControllerContext,
        book: StepBook,
        faults: FaultInjector,
        on_death: Callable[[list[int]], None],
        log: Callable[[dict[str, Any]], None] = lambda row: None,
    ) -> None:
        self.cfg, self.table, self.outbox, self.out = ctx.cfg, ctx.table, ctx.outbox, ctx.out
        self.book, self.faults = book, faults
        self.on_death = on_death
        self.log = log  # one row per micro-batch done (what the simulator calibrates training from)
        self.ledger = MicroBatchLedger()
        self.version = 0  # optimizer steps done; the step being trained
        self.handle: Any = None  # the newest weights' transfer handle

    def busy(self, cell: Cell) -> bool:
        return self.ledger.in_flight(cell.index) > 0

    def assign(self) -> None:
        depth = self.cfg.sched.micro_batches_in_flight
        training = [c.index for c in self.table.training()]
        for index, ref in hand_out(self.ledger, self.version, training, depth):
            cell = self.table.cells[index]
            self.outbox.send(cell.rank, MicroBatchAssignment(self.version, (ref.index,), (ref,)))
            cell.micro_batches += 1
            self.faults.after_assignment(cell)

    def on_ack(self, body: Any, ack: Ack) -> None:
        """Acks that arrive while the controller waits for something else: micro-batches done."""
        if not isinstance(body, MicroBatchAssignment):
            return  # a late answer to a sync that was redone after a cell died
        cell = self.table.by_rank(ack.rank)
        if not cell.alive:
            return  # its work went back to pending when it was declared dead
        for ref in body.refs:
            self.ledger.done(cell.index, ref)
        rec = self.book.steps[body.step]
        rec.train_metrics.append(ack.detail["metrics"])
        rec.train_metrics_by_cell.setdefault(cell.index, []).append(ack.detail["metrics"])
        tokens = sum(r.tokens for r in body.refs)
        self.log({"event": "micro_batch", "step": body.step, "cell": cell.index, "tokens": tokens,
                  "seconds": round(ack.detail["seconds"], 4)})  # fmt: skip

    def waiting_work(self) -> int:
        """Work of the current step that no cell has taken (gyre.sched.policy.ledger.waiting_work)."""
        rec = self.book.steps.get(self.version)
        return 0 if rec is None else waiting_work(self.ledger, self.version, rec.all_shards_written)

    def update_waits(self) -> bool:
        """The waiting work is the step's update (gyre.sched.policy.ledger.update_waits): only the core makes it."""
        rec = self.book.steps.get(self.version)
        return rec is not None and update_waits(self.ledger, self.version, rec.all_shards_written)

    def ready(self) -> bool:
        rec = self.book.steps.get(self.version)
        core_trains = self.table.cells[0].role == "train"
        return rec is not None and step_ready(self.ledger, self.version, rec.all_shards_written, core_trains)

    def finish_step(self) -> dict[str, Any]:
        """Reduce to the core, step, publish, sync every living cell; returns the step's training metrics."""
        step = self.version
        rec = self.book.steps[step]
        core = self.table.cells[0]
        contributors = [self.table.cells[c].rank for c in sorted(self.ledger.contributors(step))]
        msg = GradientReduce(step, core.rank, tuple(contributors), 1.0 / max(rec.loss_rollouts, 1), str(step + 1))
        t0 = time.monotonic()
        try:
            acks = self.outbox.call({r: msg for r in {core.rank, *contributors}}, self.on_ack, self._dead_ranks)
        except CellDied as e:
            raise RuntimeError(
                f"cells at ranks {e.ranks} died while step {step}'s gradients were reduced; a death during the "
                "reduction is not survived (only before it); rerun"
            ) from e
        reduced = self.ledger.close_step(step)
        self.handle = acks[core.rank].detail["handle"]
        t1 = time.monotonic()
        self.version = step + 1
        synced = self.take_new_version()
        return {
            **{f"train/{k}": v for k, v in acks[core.rank].detail["metrics"].items()},
            "contributors": {str(c): n for c, n in sorted(reduced.items())},
            "mb_reassigned": self.ledger.reassigned.get(step, 0),
            "reduce_s": round(t1 - t0, 4),
            "sync_s": round(time.monotonic() - t1, 4),
            # bytes each rank of each cell pulled through the weight transport for this version
            "sync_pulled_bytes": {
                str(self.table.by_rank(r).index): a.detail.get("pulled_bytes", []) for r, a in synced.items()
            },
        }

    def take_new_version(self) -> dict[int, Ack]:
        """Every living cell loads the newest version, then the engines' shared KV store is emptied of the
        previous version's KV (clear_kv_store); returns the cells' acks."""
        synced = self.sync_weights()
        self.clear_kv_store()
        return synced

    def sync_weights(self) -> dict[int, Ack]:
        """Every living cell loads the newest version (redone for the survivors if a cell dies meanwhile);
        returns their acks."""
        while True:
            alive = self.table.alive()
            peers = tuple(c.rank for c in alive if c.index != 0)
            msgs = {c.rank: WeightVersion(str(self.version), self.handle, peers) for c in alive}
            try:
                return self.outbox.call(msgs, self.on_ack, self._dead_ranks)
            except CellDied as e:
                self.on_death(e.ranks)

    def clear_kv_store(self) -> None:
        """Once every living cell took the new version (sync_weights), and before the controller hands out
        anything more: empty the KV store the engines' HiCache shares (its keys carry no weight version), through
        each living cell's engine (gyre.engine.hicache)."""
        if self.cfg.engine.backend != "sglang" or self.cfg.engine.hicache_storage_backend != "mooncake":
            return
        from gyre.engine.hicache import clear_store

        clear_store([c.engine_url for c in self.table.alive() if c.engine_url])

    def _dead_ranks(self) -> list[int]:
        return [c.rank for c in self.table.newly_dead()]
