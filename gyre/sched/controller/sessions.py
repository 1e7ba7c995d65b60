"""Rollout sessions under admission control: at most `capacity` harnesses run at once, the rest queue.

The driver runs its own asyncio loop in a thread. The controller submits a step's sessions when the
staleness bound lets that step start, sets the capacity whenever the rollout cells change, reads the
level (queued, running) and takes finished sessions from `events`. Which queued session takes a freed slot
is `sched.admission` (gyre.sched.policy.admission: by default the oldest step's group that looks longest).
Each session is one black-box harness run through gyre.harness.runner (own workspace, own process group,
graded at the end). A session holds its slot while its harness runs: once the harness has ended it makes
no model call, and its grading (a SWE-bench instance's tests can run for minutes) runs outside the
capacity, so the slot goes to the next session at once and `level` no longer counts it.

Eval sessions (gyre.sched.controller.evaluation) hold only slots that no training session wants: one starts
only when no training session waits, and the moment a training session waits for a slot an eval session
holds, or the capacity shrinks below what is running, the newest eval session is preempted (its harness
killed, its slot handed over at once) and queued again under a new attempt id, to run from the start later.
`slots` records every change of the counts, so a run can show that no training session ever waited on one.
"""

from __future__ import annotations

import asyncio
import queue
import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

from gyre.config.schema import HarnessConfig, TaskConfig
from gyre.harness.runner import RolloutOutcome, run_rollout
from gyre.proxy.keys import RolloutKeys
from gyre.sandbox import Sandbox
from gyre.sched.policy.admission import AdmissionOrder
from gyre.tasks.task import Task


@dataclass(frozen=True)
class SessionJob:
    step: int  # train: the RL step; eval: the weight version evaluated
    group: int  # train: the group; eval: the task's index in the eval set
    task: Task
    rollout_id: str
    kind: str = "train"  # eval: held-out evaluation (gyre.sched.controller.evaluation), started only when no train session waits
    harness: HarnessConfig | None = None  # this session's harness settings (eval: its temperature); None: the run's
    attempt: int = 0  # eval: how many times it was preempted before (its rollout_id ends in .<attempt>)

    def retry(self) -> SessionJob:
        """The job again after a preemption, under its own id: the killed attempt's calls and workspace stay apart."""
        base = self.rollout_id.rsplit(".", 1)[0] if self.attempt else self.rollout_id
        return replace(self, rollout_id=f"{base}.{self.attempt + 1}", attempt=self.attempt + 1)


@dataclass
class SessionDone:
    job: SessionJob
    outcome: RolloutOutcome | None
    started: float
    ended: float  # a preempted eval session: when its slot was taken (its harness is killed just after)
    error: str = ""
    queued_s: float = 0.0  # from submit to start
    harness_ended: float = 0.0  # when its harness ended and its slot was freed (0: it failed before)
    preempted: bool = False  # an eval session whose slot a training session took: no outcome; run again


@dataclass(frozen=True)
class SlotCounts:
    """The driver's counts after one change (t: time.monotonic())."""

    t: float
    queued_train: int
    running_train: int
    queued_eval: int
    running_eval: int
    capacity: int


@dataclass
class _Running:
    job: SessionJob
    started: float
    queued_s: float
    task: asyncio.Task | None = None
    freed: float = 0.0  # when its slot was freed: its harness ended, or (an eval session) it was preempted


class RolloutDriver:
    def __init__(
        self,
        proxy_url: str,
        root: Path,
        harness: HarnessConfig,
        tasks: TaskConfig,
        sandbox: Sandbox,
        keys: RolloutKeys | None,
    ) -> None:
        self.proxy_url, self.root, self.harness, self.tasks = proxy_url, root, harness, tasks
        self.order = AdmissionOrder()  # which queued training session starts next (under the lock)
        self.sandbox, self.keys = sandbox, keys
        self.events: queue.SimpleQueue[SessionDone] = queue.SimpleQueue()
        self.slot_freed = threading.Event()  # a harness ended: the level changed before its session's event
        self.slots: list[SlotCounts] = []  # every change of the counts below, in order
        self._lock = threading.Lock()
        self._pending: deque[tuple[SessionJob, float]] = deque()  # (job, submitted at)
        self._pending_eval: deque[tuple[SessionJob, float]] = deque()  # started only when no train session waits
        self._running = 0
        self._evals: dict[str, _Running] = {}  # running eval sessions by rollout id, oldest first
        self._preempted: set[str] = set()  # eval sessions whose slot was taken, until their task has ended
        self._capacity = 0
        self._tasks: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gyre-rollouts", daemon=True)
        self._thread.start()

    def submit(self, jobs: list[SessionJob]) -> None:
        now = time.time()
        with self._lock:
            for job in jobs:
                (self._pending_eval if job.kind == "eval" else self._pending).append((job, now))
            self._yield_eval_slots(now)
        self._loop.call_soon_threadsafe(self._pump)

    def set_admission(self, rule: str) -> None:
        """Start queued training sessions by `rule` (sched.admission) from now on."""
        with self._lock:
            self.order = AdmissionOrder(rule)

    def set_capacity(self, sessions: int) -> None:
        with self._lock:
            self._capacity = sessions
            self._yield_eval_slots(time.time())
        self._loop.call_soon_threadsafe(self._pump)

    def level(self, evals: bool = True) -> tuple[int, int]:
        """(queued, running) sessions; without `evals`, training sessions only (what a cell scheduler serves:
        eval sessions take only slots nobody else wants, and give them up when they are wanted)."""
        with self._lock:
            if evals:
                return len(self._pending) + len(self._pending_eval), self._running
            return len(self._pending), self._running - len(self._evals)

    def eval_level(self) -> int:
        """Eval sessions queued or running."""
        with self._lock:
            return len(self._pending_eval) + len(self._evals)

    def workdir(self, job: SessionJob) -> Path:
        return self.root / (f"step{job.step:04d}" if job.kind == "train" else f"eval{job.step:04d}") / job.rollout_id

    def _note(self) -> None:
        """Record the counts (under the lock)."""
        running_eval = len(self._evals)
        counts = (len(self._pending), self._running - running_eval, len(self._pending_eval), running_eval)
        self.slots.append(SlotCounts(time.monotonic(), *counts, self._capacity))

    def _yield_eval_slots(self, now: float) -> None:
        """Preempt eval sessions (newest first) holding slots that waiting or running training sessions want
        (under the lock): a slot changes hands here, before the harness is killed."""
        running_train = self._running - len(self._evals)
        free_for_eval = max(0, self._capacity - running_train - len(self._pending))
        for rollout_id in list(self._evals)[free_for_eval:][::-1]:
            self._pending_eval.appendleft((self._preempt(rollout_id, now).retry(), now))
        self._note()

    def drop_evals(self) -> None:
        """Forget every eval session: queued ones are dropped, running ones preempted and not run again (an
        eval of newer weights replaces them)."""
        now = time.time()
        with self._lock:
            self._pending_eval.clear()
            for rollout_id in list(self._evals):
                self._preempt(rollout_id, now)
            self._note()

    def _preempt(self, rollout_id: str, now: float) -> SessionJob:
        """Take a running eval session's slot now (under the lock); its harness is killed just after."""
        run = self._evals.pop(rollout_id)
        run.freed = now
        self._running -= 1
        self._preempted.add(rollout_id)
        self.events.put(SessionDone(run.job, None, run.started, now, queued_s=run.queued_s, preempted=True))
        self._loop.call_soon_threadsafe(self._cancel, run)
        return run.job

    def _cancel(self, run: _Running) -> None:
        if run.task is not None:  # created in the same loop callback that started it: set by now
            run.task.cancel()

    def _pump(self) -> None:
        while True:
            with self._lock:
                queue_ = self._pending or self._pending_eval
                if not queue_ or self._running >= self._capacity:
                    return
                now = time.time()
                job, submitted = self._next(queue_, now)
                self._running += 1
                run = _Running(job, now, now - submitted)
                if job.kind == "eval":
                    self._evals[job.rollout_id] = run
                self._note()
            run.task = self._loop.create_task(self._run(run))
            self._tasks.add(run.task)
            run.task.add_done_callback(self._tasks.discard)

    def _next(self, queue_: deque[tuple[SessionJob, float]], now: float) -> tuple[SessionJob, float]:
        """Take the queued session that starts next (under the lock): a training one by the admission order,
        an eval one (only when no training one waits) in the order queued."""
        if queue_ is self._pending_eval:
            return queue_.popleft()
        i = self.order.pick([(job.step, job.group) for job, _ in queue_], now)
        picked = queue_[i]
        del queue_[i]
        job = picked[0]
        self.order.started((job.step, job.group), job.rollout_id, now)
        self.order.forget_before(min(j.step for j, _ in queue_) if queue_ else job.step)
        return picked

    async def _run(self, run: _Running) -> None:
        job = run.job
        outcome, error = None, ""
        try:
            outcome = await run_rollout(
                job.task, job.rollout_id, self.proxy_url, self.workdir(job), job.harness or self.harness, self.tasks,
                sandbox=self.sandbox, keys=self.keys, on_harness_end=lambda: self._harness_ended(run),
            )  # fmt: skip
        except asyncio.CancelledError:
            if job.rollout_id not in self._preempted:
                raise  # close(): the run stops
        except Exception as e:  # noqa: BLE001 - handed to the controller, which stops the run with it
            error = f"{type(e).__name__}: {e}"
        finally:
            with self._lock:
                preempted = job.rollout_id in self._preempted
                self._preempted.discard(job.rollout_id)
            harness_ended = run.freed
            self._free_slot(run)  # a preempted session gave its slot up when it was preempted
        if preempted:  # its event went out at the preemption; a result that came meanwhile is dropped
            if not self.harness.keep_workspaces:
                shutil.rmtree(self.workdir(job), ignore_errors=True)
        else:
            self.events.put(SessionDone(job, outcome, run.started, time.time(), error, run.queued_s, harness_ended))
        self._pump()

    def _harness_ended(self, run: _Running) -> None:
        """The session's harness ended: its grading needs no slot, the next session takes it."""
        self._free_slot(run)
        self.slot_freed.set()
        self._pump()

    def _free_slot(self, run: _Running) -> None:
        """The session's slot is free (once): its harness ended, or it failed or was cancelled."""
        with self._lock:
            if run.freed:
                return
            run.freed = time.time()
            self._running -= 1
            self._evals.pop(run.job.rollout_id, None)
            if run.job.kind == "train":
                self.order.ended((run.job.step, run.job.group), run.job.rollout_id, run.freed)
            self._note()

    def close(self, timeout_s: float = 30.0) -> None:
        """Cancel running sessions (their harness process groups are killed) and stop the loop."""

        async def cancel_all() -> None:
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(timeout_s)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
