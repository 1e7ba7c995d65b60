"""Eval sessions are the driver's lowest-priority work: one starts only when no training session waits."""

import asyncio

import pytest

from gyre.config.schema import HarnessConfig, TaskConfig
from gyre.sched.controller import sessions as rollout_driver
from gyre.sched.controller.sessions import RolloutDriver, SessionJob
from gyre.tasks.families import write_value_task

pytestmark = pytest.mark.unit


def test_eval_sessions_start_only_when_no_training_session_waits(monkeypatch, tmp_path):
    started: list[str] = []

    async def fake_rollout(task, rollout_id, *args, **kwargs):  # records the start order only
        started.append(rollout_id)
        await asyncio.sleep(0.01)

    monkeypatch.setattr(rollout_driver, "run_rollout", fake_rollout)
    driver = RolloutDriver("http://127.0.0.1:1", tmp_path, HarnessConfig(), TaskConfig(), sandbox=None, keys=None)
    task = write_value_task("a.txt", "x")
    evals = [SessionJob(0, 0, task, f"e0-t0-r{i}", kind="eval") for i in range(3)]
    train = [SessionJob(1, 0, task, f"s1-g0-r{i}") for i in range(3)]
    try:
        driver.submit(evals)
        driver.submit(train)  # later, yet first to run
        assert driver.level() == (6, 0) and driver.level(queued_eval=False) == (3, 0)
        assert driver.eval_level() == 3
        driver.set_capacity(1)
        done = [driver.events.get(timeout=10) for _ in range(6)]
    finally:
        driver.close()
    assert started == [j.rollout_id for j in train + evals]
    assert {d.job.kind for d in done} == {"train", "eval"} and driver.eval_level() == 0
