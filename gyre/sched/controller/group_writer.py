"""Group shards written and planned off the controller's loop.

A completed group's shard takes 0.6-0.9 s to score, write and plan on a busy machine; done inline, every
decision the policy would take meanwhile (a release, a return, a micro-batch handed out) waits behind it.
One thread owns every group-shard write (h5py serialises its calls under one lock anyway, so one writer
loses nothing), in the order the groups completed; the loop hands a group over and takes the written
shards and their micro-batches when it next looks. An eval task's samples (gyre.sched.controller.evaluation)
are written the same way, into the eval's shard directory, and never planned.
"""

from __future__ import annotations

import queue
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gyre.comm.messages import MicroBatchRef
from gyre.config.schema import RunConfig
from gyre.pipeline import FinishedRollout, GroupShard, write_group_shard
from gyre.sched.replica import plan_group


@dataclass(frozen=True)
class GroupJob:
    """A completed group, ready to be scored and written (its members in any order: the shard holds them by
    rollout id); `workdirs`: its sessions' workspaces, removed after the write unless `harness.keep_workspaces`."""

    step: int
    group: int
    members: list[FinishedRollout]
    skipped: Mapping[str, str]
    workdirs: Path
    handed_over: float = field(default_factory=time.monotonic)
    kind: str = "train"  # "eval": one eval task's samples after weight version `step`, written to `shard_dir`
    shard_dir: Path | None = None  # where its shard goes; None: the writer's (the training shards)


@dataclass(frozen=True)
class WrittenGroup:
    step: int
    group: int
    shard: GroupShard
    refs: list[MicroBatchRef]  # its micro-batches
    trained: list[str]  # ids of the rollouts they train
    loss_rollouts: int  # |R| this group adds to the step's loss (rl.loss_norm)
    write_s: float  # scoring, writing and planning, on the writer's thread
    waited_s: float  # from the hand-over to the start of the write (groups ahead of it)
    kind: str = "train"  # the job's: an eval shard has no micro-batches


class GroupWriter:
    """One thread that scores, writes and plans each handed-over group. `done()` returns the groups written
    since the last look; an error on the writer's thread is raised there, in the loop."""

    def __init__(self, cfg: RunConfig, shard_dir: Path) -> None:
        self.cfg, self.shard_dir = cfg, shard_dir
        self._todo: queue.SimpleQueue[GroupJob | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[WrittenGroup | BaseException] = queue.SimpleQueue()
        self.in_flight = 0  # handed over, not yet taken back by done()
        self._thread = threading.Thread(target=self._work, name="gyre-group-writer", daemon=True)
        self._thread.start()

    def submit(self, job: GroupJob) -> None:
        self.in_flight += 1
        self._todo.put(job)

    def has_news(self) -> bool:
        return not self._done.empty()

    def done(self) -> list[WrittenGroup]:
        out = []
        while not self._done.empty():
            got = self._done.get()
            self.in_flight -= 1
            if isinstance(got, BaseException):
                raise RuntimeError(f"writing a group shard failed: {got}") from got
            out.append(got)
        return out

    def drain(self, timeout: float) -> list[WrittenGroup]:
        """Wait up to `timeout` s for every handed-over group (the end of a run, a test)."""
        deadline = time.monotonic() + timeout
        out: list[WrittenGroup] = []
        while self.in_flight > 0 and time.monotonic() < deadline:  # done() counts what it takes back
            time.sleep(0.01)
            out += self.done()
        return out

    def close(self, wait_s: float = 30.0) -> None:
        """Stop once the groups already handed over are written, waiting up to `wait_s` for them: a shard
        on disk is one a resumed run keeps (gyre.resume.kept_groups), a half-written one it discards."""
        self._todo.put(None)
        self._thread.join(wait_s)

    def _work(self) -> None:
        while (job := self._todo.get()) is not None:
            try:
                self._done.put(self._write(job))
            except Exception as e:  # noqa: BLE001 - handed to the loop, which raises it
                self._done.put(e)

    def _write(self, job: GroupJob) -> WrittenGroup:
        start = time.monotonic()
        members = sorted(job.members, key=lambda r: r.outcome.rollout_id)
        shard_dir = job.shard_dir or self.shard_dir
        shard = write_group_shard(self.cfg, shard_dir, job.step, job.group, members, job.skipped, kind=job.kind)
        if not self.cfg.harness.keep_workspaces:
            for m in members:
                shutil.rmtree(job.workdirs / m.outcome.rollout_id, ignore_errors=True)
        refs, trained, n_loss = plan_group(shard.path, self.cfg) if job.kind == "train" else ([], [], 0)
        seconds = time.monotonic() - start
        return WrittenGroup(
            job.step, job.group, shard, refs, trained, n_loss, seconds, start - job.handed_over, job.kind
        )
