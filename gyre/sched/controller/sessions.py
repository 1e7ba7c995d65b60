"""Rollout sessions under admission control: at most `capacity` harnesses run at once, the rest queue.

The driver runs its own asyncio loop in a thread. The controller submits a step's sessions when the
staleness bound lets that step start, sets the capacity whenever the rollout cells change, reads the
level (queued, running) and takes finished sessions from `events`. Each session is one black-box
harness run through gyre.harness.runner (own workspace, own process group, graded at the end).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from gyre.config.schema import HarnessConfig, TaskConfig
from gyre.harness.runner import RolloutOutcome, run_rollout
from gyre.proxy.keys import RolloutKeys
from gyre.sandbox import Sandbox
from gyre.tasks.task import Task


@dataclass(frozen=True)
class SessionJob:
    step: int  # train: the RL step; eval: the weight version evaluated
    group: int  # train: the group; eval: the task's index in the eval set
    task: Task
    rollout_id: str
    kind: str = "train"  # eval: held-out evaluation (gyre.sched.controller.evaluation), started only when no train session waits
    harness: HarnessConfig | None = None  # this session's harness settings (eval: its temperature); None: the run's


@dataclass
class SessionDone:
    job: SessionJob
    outcome: RolloutOutcome | None
    started: float
    ended: float
    error: str = ""


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
        self.sandbox, self.keys = sandbox, keys
        self.events: queue.SimpleQueue[SessionDone] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: deque[SessionJob] = deque()
        self._pending_eval: deque[SessionJob] = deque()  # lower priority: start when no train session waits
        self._running = 0
        self._running_eval = 0
        self._capacity = 0
        self._tasks: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gyre-rollouts", daemon=True)
        self._thread.start()

    def submit(self, jobs: list[SessionJob]) -> None:
        with self._lock:
            for job in jobs:
                (self._pending_eval if job.kind == "eval" else self._pending).append(job)
        self._loop.call_soon_threadsafe(self._pump)

    def set_capacity(self, sessions: int) -> None:
        with self._lock:
            self._capacity = sessions
        self._loop.call_soon_threadsafe(self._pump)

    def level(self, queued_eval: bool = True) -> tuple[int, int]:
        """(queued, running) sessions, running eval sessions included (they hold their engine's KV); queued
        eval sessions only with `queued_eval` (they wait for idle capacity and call no cell back to serve)."""
        with self._lock:
            return len(self._pending) + (len(self._pending_eval) if queued_eval else 0), self._running

    def eval_level(self) -> int:
        """Eval sessions queued or running."""
        with self._lock:
            return len(self._pending_eval) + self._running_eval

    def workdir(self, job: SessionJob) -> Path:
        return self.root / (f"step{job.step:04d}" if job.kind == "train" else f"eval{job.step:04d}") / job.rollout_id

    def _pump(self) -> None:
        while True:
            with self._lock:
                queue_ = self._pending or self._pending_eval
                if not queue_ or self._running >= self._capacity:
                    return
                job = queue_.popleft()
                self._running += 1
                self._running_eval += job.kind == "eval"
            task = self._loop.create_task(self._run(job))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, job: SessionJob) -> None:
        started = time.time()
        outcome, error = None, ""
        try:
            outcome = await run_rollout(
                job.task, job.rollout_id, self.proxy_url, self.workdir(job), job.harness or self.harness, self.tasks,
                sandbox=self.sandbox, keys=self.keys,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - handed to the controller, which stops the run with it
            error = f"{type(e).__name__}: {e}"
        finally:
            with self._lock:
                self._running -= 1
                self._running_eval -= job.kind == "eval"
        self.events.put(SessionDone(job, outcome, started, time.time(), error))
        self._pump()

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
