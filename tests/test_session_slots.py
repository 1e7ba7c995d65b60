"""A session holds its slot while its harness runs, not while it is graded: once the harness has ended the
rollout makes no model call, so the next session takes the slot at once (a SWE-bench instance's tests can
run for minutes)."""

import asyncio
import time

import pytest

from gyre.config.schema import HarnessConfig, TaskConfig
from gyre.harness import runner
from gyre.sched.controller import sessions as rollout_driver
from gyre.sched.controller.sessions import RolloutDriver, SessionJob
from gyre.tasks.families import write_value_task

pytestmark = pytest.mark.unit
TASK = write_value_task("a.txt", "x")
HARNESS_S, GRADE_S = 0.2, 0.6


def two_phase(log: list[tuple[str, str, float]]):
    """A rollout whose harness runs HARNESS_S, then whose grading runs GRADE_S (the order and times logged)."""

    async def rollout(task, rollout_id, *args, on_harness_end=None, **kwargs):
        log.append(("start", rollout_id, time.monotonic()))
        await asyncio.sleep(HARNESS_S)
        on_harness_end()
        log.append(("graded from", rollout_id, time.monotonic()))
        await asyncio.sleep(GRADE_S)
        log.append(("done", rollout_id, time.monotonic()))

    return rollout


def when(log, what: str, rollout_id: str) -> float:
    return next(t for w, r, t in log if (w, r) == (what, rollout_id))


def test_the_next_session_takes_the_slot_while_the_last_is_graded(monkeypatch, tmp_path):
    log: list[tuple[str, str, float]] = []
    monkeypatch.setattr(rollout_driver, "run_rollout", two_phase(log))
    driver = RolloutDriver("http://127.0.0.1:1", tmp_path, HarnessConfig(), TaskConfig(), sandbox=None, keys=None)
    jobs = [SessionJob(0, 0, TASK, f"s0-g0-r{i}") for i in range(3)]
    try:
        driver.set_capacity(1)
        driver.submit(jobs)
        deadline = time.monotonic() + 10
        while not any(w == "start" and r == "s0-g0-r1" for w, r, _ in log):
            assert time.monotonic() < deadline, "the second session never started"
            time.sleep(0.005)
        levels = driver.level()  # r0 graded, r1 in its harness, r2 queued
        done = [driver.events.get(timeout=10) for _ in range(3)]
    finally:
        driver.close()
    # each session started the moment the one before it left its harness, not once it was graded
    for a, b in zip(jobs, jobs[1:], strict=False):
        assert when(log, "start", b.rollout_id) < when(log, "done", a.rollout_id) - GRADE_S / 2
        assert when(log, "start", b.rollout_id) >= when(log, "graded from", a.rollout_id)
    assert levels == (1, 1)  # the session being graded is not counted
    assert max(s.running_train for s in driver.slots) == 1  # the capacity held throughout
    for d in done:  # the slot was freed at the harness's end; the session ended a grading later
        assert d.harness_ended and d.ended - d.harness_ended == pytest.approx(GRADE_S, abs=0.15)


def test_run_rollouts_starts_the_next_harness_while_the_last_is_graded(monkeypatch, tmp_path):
    log: list[tuple[str, str, float]] = []
    monkeypatch.setattr(runner, "run_rollout", two_phase(log))
    jobs = [(TASK, f"r{i}") for i in range(2)]
    asyncio.run(runner.run_rollouts(jobs, "http://127.0.0.1:1", tmp_path, HarnessConfig(concurrency=1), TaskConfig()))
    assert when(log, "graded from", "r0") <= when(log, "start", "r1") < when(log, "done", "r0")
