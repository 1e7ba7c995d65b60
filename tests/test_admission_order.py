"""Which queued session takes a freed slot (gyre.sched.policy.admission): the oldest step's, a group not yet
started first, then the group whose rollouts have run longest; `fifo` as submitted. The rollout driver and the
simulator both call it."""

import asyncio
from dataclasses import replace

import pytest

from gyre.config.schema import HarnessConfig, RunConfig, TaskConfig
from gyre.sched.controller import sessions as rollout_driver
from gyre.sched.controller.sessions import RolloutDriver, SessionJob
from gyre.sched.policy.admission import AdmissionOrder
from gyre.sim.simulator import simulate
from gyre.sim.workload import Call, CellModel, Rollout, RunShape, Trace
from gyre.tasks.families import write_value_task

pytestmark = pytest.mark.unit


def test_a_group_not_yet_started_goes_first_then_the_longest_seen():
    order = AdmissionOrder()
    queued = [(0, 0), (0, 0), (0, 1), (0, 2)]
    assert order.pick(queued, 0.0) == 0  # nothing seen: as submitted
    order.started((0, 0), "s0-g0-r0", 0.0)
    assert order.pick(queued[1:], 1.0) == 1  # group 1 has not started: its probe goes before g0's second
    order.started((0, 1), "s0-g1-r0", 1.0)
    order.started((0, 2), "s0-g2-r0", 1.0)
    order.ended((0, 1), "s0-g1-r0", 1.5)  # group 1 took 0.5 s; group 0 has run 3 s so far, group 2 2 s
    assert order.pick([(0, 1), (0, 2), (0, 0)], 3.0) == 2
    order.ended((0, 0), "s0-g0-r0", 3.0)
    order.ended((0, 2), "s0-g2-r0", 9.0)  # group 2 ran 8 s: it now looks longest
    assert order.pick([(0, 1), (0, 0), (0, 2)], 9.0) == 2
    assert order.pick([(0, 1), (0, 1)], 9.0) == 0  # ties as submitted


def test_the_oldest_step_goes_first():
    order = AdmissionOrder()
    order.started((1, 0), "s1-g0-r0", 0.0)
    order.ended((1, 0), "s1-g0-r0", 50.0)
    assert order.pick([(2, 3), (1, 0), (2, 0)], 60.0) == 1  # step 1's seen group before step 2's probes
    assert order.pick([(2, 3), (2, 0)], 60.0) == 0


def test_fifo_takes_the_queue_as_submitted():
    order = AdmissionOrder("fifo")
    order.started((0, 0), "a", 0.0)
    assert order.pick([(1, 0), (0, 1), (0, 0)], 5.0) == 0


def test_forgetting_a_step_keeps_groups_still_running():
    order = AdmissionOrder()
    order.started((0, 0), "a", 0.0)
    order.started((0, 1), "b", 0.0)
    order.ended((0, 1), "b", 1.0)
    order.forget_before(1)
    order.ended((0, 0), "a", 7.0)  # still known: it was running
    # group 1 was forgotten (unseen again: it goes first), group 0 was kept (were it forgotten too: as submitted)
    assert order.pick([(0, 0), (0, 1)], 8.0) == 1
    order.ended((0, 5), "never-started", 9.0)  # an unknown session changes nothing


def test_an_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="sched.admission='lifo'"):
        AdmissionOrder("lifo")
    with pytest.raises(ValueError, match="sched.admission='lifo': choose one of group_length, fifo"):
        RunConfig(sched=replace(RunConfig().sched, admission="lifo"))


def durations_by_group(log: list[str], seconds: dict[int, float]):
    async def rollout(task, rollout_id, *args, on_harness_end=None, **kwargs):
        log.append(rollout_id)
        await asyncio.sleep(seconds[int(rollout_id.split("-")[1][1:])])
        on_harness_end()

    return rollout


@pytest.mark.parametrize(("rule", "expected"), [
    ("group_length", ["s0-g0-r0", "s0-g1-r0", "s0-g0-r1", "s0-g1-r1"]),
    ("fifo", ["s0-g0-r0", "s0-g0-r1", "s0-g1-r0", "s0-g1-r1"]),
])  # fmt: skip
def test_the_driver_starts_sessions_in_the_admission_order(monkeypatch, tmp_path, rule, expected):
    log: list[str] = []
    monkeypatch.setattr(rollout_driver, "run_rollout", durations_by_group(log, {0: 0.4, 1: 0.02}))
    driver = RolloutDriver("http://127.0.0.1:1", tmp_path, HarnessConfig(), TaskConfig(), None, None)
    driver.set_admission(rule)
    task = write_value_task("a.txt", "x")
    try:
        driver.submit([SessionJob(0, g, task, f"s0-g{g}-r{i}") for g in (0, 1) for i in (0, 1)])
        driver.set_capacity(2)
        done = [driver.events.get(timeout=10) for _ in range(4)]
    finally:
        driver.close()
    assert not any(d.error for d in done)
    assert log == expected  # group_length: g1's probe before g0's second; once g1 ended fast, g0's second


def test_the_simulator_admits_in_the_same_order():
    """Two groups of a step, the first short and the second long. On one slot every order ends at the sum; on
    two, group_length runs both probes, then the long group's rollouts, and the step ends sooner than in
    submission order."""
    cell = CellModel(capacity=1, decode_tps=1e9, session_tps=1e9, prefill_tps=1e12, call_s=0.0, train_tps=1e9,
                     micro_batch_s=0.0, to_train_s=0.0, to_rollout_s=0.0, reduce_s=0.0, sync_s=0.0)  # fmt: skip
    tool = {0: 1.0, 1: 10.0}
    rollouts = [Rollout(f"s0-g{g}-r{i}", g, (Call(1, 1, tool[g]),), 0.0, 10) for g in (0, 1) for i in range(3)]
    shape = RunShape(steps=1, groups_per_step=2, group_size=3, n_cells=1, staleness=0)
    walls = {
        rule: simulate("colocate_cells", cell, replace(shape, admission=rule), Trace({0: rollouts})).wall_s
        for rule in ("fifo", "group_length")
    }
    assert walls["fifo"] == pytest.approx(33.0, abs=0.1)  # one slot: 1 + 1 + 1 + 10 + 10 + 10
    assert walls["group_length"] == pytest.approx(33.0, abs=0.1)  # one slot holds every order to the sum
    two = replace(cell, capacity=2)
    walls = {
        rule: simulate("colocate_cells", two, replace(shape, admission=rule), Trace({0: rollouts})).wall_s
        for rule in ("fifo", "group_length")
    }
    # fifo: g0 r0 r1 | g0 r2 + g1 r0 | g1 r1 | g1 r2 on two slots ends at 21 (1, then 2..11, 11..21);
    # group_length: the probes g0 r0 + g1 r0, then g1's r1 and r2 (it looks longest) beside g0's: 20
    assert walls["fifo"] == pytest.approx(21.0, abs=0.1)
    assert walls["group_length"] == pytest.approx(20.0, abs=0.1)
