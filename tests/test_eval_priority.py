"""Eval sessions are the driver's lowest-priority work: one starts only when no training session waits, and
gives its slot up (preempted, run again later under a new id) the moment a training session wants it."""

import asyncio
import time

import pytest

from gyre.config.schema import HarnessConfig, TaskConfig
from gyre.sched.controller import sessions as rollout_driver
from gyre.sched.controller.sessions import RolloutDriver, SessionJob, SlotCounts
from gyre.tasks.families import write_value_task

pytestmark = pytest.mark.unit
TASK = write_value_task("a.txt", "x")


def fake_driver(monkeypatch, tmp_path, started: list[str], seconds: float) -> RolloutDriver:
    async def fake_rollout(task, rollout_id, *args, **kwargs):  # records the start order only
        started.append(rollout_id)
        await asyncio.sleep(seconds)

    monkeypatch.setattr(rollout_driver, "run_rollout", fake_rollout)
    return RolloutDriver("http://127.0.0.1:1", tmp_path, HarnessConfig(), TaskConfig(), sandbox=None, keys=None)


def evals(n: int) -> list[SessionJob]:
    return [SessionJob(0, 0, TASK, f"e0-t0-r{i}", kind="eval") for i in range(n)]


def trains(n: int, step: int = 1) -> list[SessionJob]:
    return [SessionJob(step, 0, TASK, f"s{step}-g0-r{i}") for i in range(n)]


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def assert_evals_hold_only_unwanted_slots(slots: list[SlotCounts]) -> None:
    """After every change: eval sessions run only in slots that no running or waiting training session wants
    (training sessions may run over the capacity for a while: a cell that leaves hands its sessions on)."""
    for s in slots:
        assert s.running_eval <= max(0, s.capacity - s.running_train - s.queued_train), s


def test_eval_sessions_start_only_when_no_training_session_waits(monkeypatch, tmp_path):
    started: list[str] = []
    driver = fake_driver(monkeypatch, tmp_path, started, 0.01)
    train = trains(3)
    try:
        driver.submit(evals(3))
        driver.submit(train)  # later, yet first to run
        assert driver.level() == (6, 0) and driver.level(evals=False) == (3, 0)
        assert driver.eval_level() == 3
        driver.set_capacity(1)
        done = [driver.events.get(timeout=10) for _ in range(6)]
    finally:
        driver.close()
    assert started == [j.rollout_id for j in train + evals(3)]
    assert {d.job.kind for d in done} == {"train", "eval"} and driver.eval_level() == 0
    assert not any(d.preempted for d in done)
    assert_evals_hold_only_unwanted_slots(driver.slots)


def test_a_training_session_takes_an_eval_sessions_slot_at_once(monkeypatch, tmp_path):
    started: list[str] = []
    driver = fake_driver(monkeypatch, tmp_path, started, 0.2)
    try:
        driver.set_capacity(2)
        driver.submit(evals(2))
        wait_until(lambda: len(started) == 2)  # both eval sessions run: the slots were idle
        driver.submit(trains(1))
        first = driver.events.get(timeout=1)  # the newest eval session, preempted in submit itself
        assert first.preempted and first.job.rollout_id == "e0-t0-r1" and first.outcome is None
        done = [first, *(driver.events.get(timeout=10) for _ in range(3))]
    finally:
        driver.close()
    # the training session ran next; the preempted one again, under its own id, once a slot was free
    assert started == ["e0-t0-r0", "e0-t0-r1", "s1-g0-r0", "e0-t0-r1.1"]
    finished = {d.job.rollout_id for d in done if not d.preempted}
    assert finished == {"e0-t0-r0", "s1-g0-r0", "e0-t0-r1.1"}
    assert_evals_hold_only_unwanted_slots(driver.slots)


def test_eval_sessions_give_up_the_slots_of_a_cell_that_leaves(monkeypatch, tmp_path):
    started: list[str] = []
    driver = fake_driver(monkeypatch, tmp_path, started, 0.2)
    try:
        driver.set_capacity(4)
        driver.submit(trains(1) + evals(3))
        wait_until(lambda: len(started) == 4)
        driver.set_capacity(2)  # a cell switched to training: one slot left beside the training session
        preempted = [driver.events.get(timeout=1) for _ in range(2)]
        assert [d.job.rollout_id for d in preempted] == ["e0-t0-r2", "e0-t0-r1"] and all(d.preempted for d in preempted)
        assert driver.eval_level() == 3 and driver.level(evals=False) == (0, 1)
        driver.set_capacity(0)  # nobody serves: no eval session keeps running
        rest = [driver.events.get(timeout=1) for _ in range(1)]
        assert rest[0].job.rollout_id == "e0-t0-r0" and rest[0].preempted
    finally:
        driver.close()
    assert_evals_hold_only_unwanted_slots(driver.slots)
    assert driver.slots[-1].running_eval == 0 and driver.slots[-1].queued_eval == 3


def test_a_retried_eval_job_keeps_its_task_and_counts_its_attempts():
    job = SessionJob(3, 1, TASK, "e3-t1-r0", kind="eval")
    again = job.retry().retry()
    assert (again.rollout_id, again.attempt, again.step, again.group) == ("e3-t1-r0.2", 2, 3, 1)


def test_dropped_evals_leave_the_queue_and_their_slots_and_do_not_come_back(monkeypatch, tmp_path):
    started: list[str] = []
    driver = fake_driver(monkeypatch, tmp_path, started, 0.2)
    try:
        driver.set_capacity(2)
        driver.submit(evals(4))
        wait_until(lambda: len(started) == 2)
        driver.drop_evals()  # a newer version's eval replaces them
        dropped = [driver.events.get(timeout=1) for _ in range(2)]
        assert all(d.preempted for d in dropped) and driver.eval_level() == 0
        driver.submit(trains(1))
        assert not driver.events.get(timeout=10).preempted
    finally:
        driver.close()
    assert started == ["e0-t0-r0", "e0-t0-r1", "s1-g0-r0"]
