"""The scheduler simulator: hand-timed runs, the production policy in the loop, the bound, calibration."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import yaml

from gyre.harness.builtin import rollout_tool_factor
from gyre.sched import policy
from gyre.sim.bound import lower_bound, workload_bound
from gyre.sim.calibrate import (
    Calibration,
    RunRecord,
    calibrate,
    calibrate_predictive,
    fit_rollouts,
    read_run,
    split_session,
)
from gyre.sim.simulator import simulate
from gyre.sim.workload import Call, CellModel, Rollout, RunShape, Trace, Workload, tool_factor

pytestmark = pytest.mark.unit

# every call takes 1 s (no tokens), every switch 0.5 s, a micro-batch of 1000 tokens 1 s, reduce + sync 0.5 s
CELL = CellModel(capacity=1, decode_tps=1e9, session_tps=1e9, prefill_tps=1e9, call_s=1.0, train_tps=1000,
                 micro_batch_s=0.0, to_train_s=0.5, to_rollout_s=0.5, reduce_s=0.25, sync_s=0.25)  # fmt: skip
SHAPE = RunShape(steps=1, groups_per_step=1, group_size=2, n_cells=2, staleness=1, micro_batch_tokens=1000)


def two_rollouts() -> Trace:
    """One group of two rollouts: a 1 s call then 2 s of tools each; 1000 tokens each to train."""
    return Trace({0: [Rollout(f"s0-g0-r{i}", 0, (Call(0, 0, 2.0),), 0.0, 1000) for i in range(2)]})


@pytest.mark.parametrize(
    ("scheduler", "wall"),
    [
        # both sessions 0-3 s; both cells switch (0.5 s), train one micro-batch each (1 s), reduce + sync (0.5 s)
        ("colocate_cells", 5.0),
        ("elastic", 5.0),
        # the core trains from the start (0.5 s switch); the one rollout cell runs the sessions one after the
        # other (0.5-3.5, 3.5-6.5); the core trains both micro-batches (6.5-8.5); reduce + sync
        ("async", 9.0),
    ],
)
def test_hand_timed_runs(scheduler: str, wall: float) -> None:
    r = simulate(scheduler, CELL, SHAPE, two_rollouts())
    assert r.wall_s == pytest.approx(wall)
    assert r.step_end_s == [pytest.approx(wall)]


def test_the_production_policy_drives_it(monkeypatch: pytest.MonkeyPatch) -> None:
    wl = Workload(calls_mean=3, prefill_per_call=10, decode_per_call=10, tool_s=2.0, tail_sigma=1.0,
                  train_tokens_per_rollout=500)  # fmt: skip
    cell = replace(CELL, capacity=4, call_s=0.1)
    shape = RunShape(steps=4, groups_per_step=4, group_size=4, n_cells=3, staleness=1, micro_batch_tokens=1000)
    base = simulate("elastic", cell, shape, wl)
    seen = []
    real = policy.decide

    def counting(p, cells, load):  # type: ignore[no-untyped-def]
        seen.append(load)
        return real(p, cells, load)

    monkeypatch.setattr(policy, "decide", counting)
    assert simulate("elastic", cell, shape, wl).wall_s == pytest.approx(base.wall_s)
    assert len(seen) == base.decisions > 0

    def release_only_when_idle(p, cells, load):  # type: ignore[no-untyped-def]
        return real(p, cells, load) if load.level == 0 or load.queued > 0 else []

    monkeypatch.setattr(policy, "decide", release_only_when_idle)
    assert simulate("elastic", cell, shape, wl).wall_s != pytest.approx(base.wall_s)
    monkeypatch.setattr(policy, "decide", lambda p, cells, load: [])  # nobody ever trains: the run cannot end
    with pytest.raises(RuntimeError, match="stalled"):
        simulate("elastic", cell, shape, wl)


def test_staleness_gate_admits_the_next_step_early() -> None:
    wl = Workload(
        calls_mean=2, prefill_per_call=0, decode_per_call=0, tool_s=1.0, tail_sigma=1.0, train_tokens_per_rollout=800
    )
    cell = replace(CELL, capacity=8)
    shape = RunShape(steps=6, groups_per_step=2, group_size=4, n_cells=2, staleness=0, micro_batch_tokens=1000)
    stale0 = simulate("elastic", cell, shape, wl).wall_s
    stale1 = simulate("elastic", cell, replace(shape, staleness=1), wl).wall_s
    assert stale1 < stale0


def test_bound_holds_and_is_tight_by_hand() -> None:
    b = lower_bound(CELL, SHAPE, two_rollouts())
    # chain: the rollouts end at 3, then the last micro-batch (1 s), reduce + sync: 4.5; work: (3+3 + 2) / 2 = 4
    assert b.chain_s == pytest.approx(4.5) and b.work_s == pytest.approx(4.0)
    wl = Workload(calls_mean=4, prefill_per_call=100, decode_per_call=50, tool_s=3.0, tail_sigma=1.0,
                  train_tokens_per_rollout=3000, overhead_s=0.5)  # fmt: skip
    cell = replace(CELL, capacity=4, decode_tps=400, session_tps=100, prefill_tps=5000, call_s=0.05)
    shape = RunShape(steps=5, groups_per_step=3, group_size=4, n_cells=3, staleness=1, micro_batch_tokens=4000)
    bound = lower_bound(cell, shape, wl).seconds
    for s in ("colocate_cells", "async", "elastic"):
        assert simulate(s, cell, shape, wl).wall_s >= bound


def test_timeout_ends_sessions() -> None:
    slow = Trace({0: [Rollout(f"s0-g0-r{i}", 0, (Call(0, 0, 100.0 * i),), 0.0, 1000) for i in range(2)]})
    r = simulate("colocate_cells", CELL, replace(SHAPE, timeout_s=10.0), slow)
    assert r.timeouts == 1
    assert r.wall_s == pytest.approx(10.0 + 0.5 + 1.0 + 0.5)


def test_tool_factor_is_the_harness_draw() -> None:
    for rid in ("s0-g0-r0", "s3-g1-r7"):
        assert tool_factor(rid, 0.5) == rollout_tool_factor(rid, 0.5)
    assert tool_factor("x", 0.0) == 1.0


def write_run(d: Path) -> None:
    """A cell job's outputs, by hand: 2 sessions of 2 calls, micro-batches of 1000 tokens in 0.5 s."""
    cfg = {"scheduler": "elastic", "steps": 1, "rl": {"groups_per_step": 1, "group_size": 2},
           "cluster": {"satellites": [{}]}, "train": {"micro_batch_tokens": 1000}, "harness": {"timeout_s": 90.0},
           "sched": {"staleness": 1, "micro_batches_in_flight": 1, "async_rollout_cells": 0, "capacity_per_cell": 3}}  # fmt: skip
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = [
        {"event": "switch", "initial": False, "direction": "rollout->train", "latency_s": 0.2, "cell": 0},
        {"event": "switch", "initial": False, "direction": "train->rollout", "latency_s": 0.1, "cell": 0},
        {"event": "micro_batch", "step": 0, "cell": 0, "tokens": 1000, "seconds": 0.5},
        {"event": "micro_batch", "step": 0, "cell": 1, "tokens": 1000, "seconds": 0.5},
        {"event": "step", "reduce_s": 0.3, "sync_s": 0.4, "tree_tokens": 2000.0},
        {"event": "group", "step": 0, "group": 0, "micro_batches": 2, "seconds": 0.25},
    ]
    calls = []
    for i in range(2):
        rid = f"s0-g0-r{i}"
        # call k of decode 10 * (k + 1) tokens alone on engine e{i}: 0.02 s + 0.01 s a token; 1.5 s of tools after
        t = 100.0 + 10 * i
        for k in range(2):
            dec = 10 * (k + 1)
            calls.append({"rollout_id": rid, "prompt_tokens": 50, "cached_tokens": 40, "output_ids": [0] * dec,
                          "t_start": t, "t_end": t + 0.02 + 0.01 * dec, "engine_url": f"e{i}"})  # fmt: skip
            t += 0.02 + 0.01 * dec + 1.5
        rows.append(
            {"event": "session", "rollout_id": rid, "step": 0, "seconds": 4.0, "harness_s": 3.5, "started": 1.0 + i}
        )
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "calls.jsonl").write_text("".join(json.dumps(c) + "\n" for c in calls))
    (d / "summary.json").write_text(json.dumps({"wall_s": 7.0}))


def test_calibration_reads_a_run(tmp_path: Path) -> None:
    write_run(tmp_path)
    cal = calibrate([read_run(tmp_path)])
    c = cal.cell
    assert c.train_tps == pytest.approx(2000) and c.capacity == 3
    assert (c.to_train_s, c.to_rollout_s, c.reduce_s, c.sync_s, c.group_write_s) == (0.2, 0.1, 0.3, 0.4, 0.25)
    assert c.call_s == pytest.approx(0.02, abs=1e-6) and c.session_tps == pytest.approx(100, rel=1e-4)
    assert cal.shape.n_cells == 2 and cal.shape.timeout_s == 90.0 and cal.measured == {"elastic": [7.0]}
    r = cal.rollouts["s0-g0-r1"]
    assert [x.prefill for x in r.calls] == [10, 10] and [x.decode for x in r.calls] == [10, 20]
    # gaps between calls, and after the last what the harness's clock has left: 3.5 - (0.12 + 0.22 + 1.5)
    assert r.calls[0].tool_s == pytest.approx(1.5) and r.calls[1].tool_s == pytest.approx(3.5 - 1.84)
    assert r.overhead_s == pytest.approx(0.5) and r.train_tokens == 1000
    again = Calibration.from_json(json.loads(json.dumps(cal.to_json())))
    record = read_run(tmp_path)
    assert [s["started"] for s in record.sessions.values()] == [1.0, 2.0]  # kept, for contention on the harness
    stored = calibrate([RunRecord.from_json(json.loads(json.dumps(record.to_json())))]).cell  # floats to 4 places
    assert asdict(stored) == pytest.approx(asdict(c), rel=1e-5)
    assert simulate("elastic", again.cell, again.shape, again.trace()).wall_s == pytest.approx(
        simulate("elastic", cal.cell, cal.shape, cal.trace()).wall_s
    )
    assert c.group_write_blocks and record.shape["tool_time_s"] == 0.0 and record.shape["cpus"] >= 1
    metrics = tmp_path / "metrics.jsonl"  # a run with the writer thread: its group rows say the loop went on
    metrics.write_text(metrics.read_text().replace('"seconds": 0.25}', '"seconds": 0.25, "blocked_s": 0.0}'))
    assert not calibrate([read_run(tmp_path)]).cell.group_write_blocks


# the cross-prediction of the recorded benchmark (tools/sim_data/bench17_runs.json.gz) before the trace was
# separated from the source scheduler's contention: median 16.4%, worst 40.0% off the diagonal
CROSS_MEDIAN_BOUND = 0.17
CROSS_WORST_BOUND = 0.41


def test_cross_prediction_of_the_recorded_benchmark() -> None:
    """Calibrated on one scheduler's runs alone, the simulator predicts the other schedulers' walls."""
    from tools.sim_schedulers import SCHEDULERS, cross_predict, load_records

    cross = cross_predict(load_records(None))
    assert set(cross["table"]) == {"sigma0.5", "sigma1.0", "trainheavy"}
    for rows in cross["table"].values():
        assert set(rows) == set(SCHEDULERS) and all(set(r) == set(SCHEDULERS) for r in rows.values())
    assert cross["repeat_noise"]["n"] == 18  # trainheavy: 3 repeats of each scheduler, each against the other 2
    assert cross["median_error"] < CROSS_MEDIAN_BOUND
    assert cross["worst_error"] < CROSS_WORST_BOUND


def test_workload_bound_is_one_for_every_scheduler(tmp_path: Path) -> None:
    """The workload's bound takes each rollout as quick as any run saw it, whichever scheduler ran it: a
    scheduler that slows its sessions does not raise it."""
    write_run(tmp_path)
    quick = read_run(tmp_path)
    slow = RunRecord.from_json(quick.to_json())
    slow.scheduler = "colocate_cells"
    for s in slow.sessions.values():  # every tool gap and the time outside the harness twice as long
        outside = s["seconds"] - s["harness_s"]
        s["harness_s"] += sum(c[3] for c in s["calls"])
        s["calls"] = [[p, d, dur, 2 * gap] for p, d, dur, gap in s["calls"]]
        s["seconds"] = s["harness_s"] + 2 * outside
    least = fit_rollouts([slow, quick], calibrate([quick]).shape, least=True)
    assert least == calibrate([quick]).rollouts
    assert workload_bound([slow, quick]).seconds == pytest.approx(workload_bound([quick, slow]).seconds)
    assert workload_bound([slow, quick]).seconds < lower_bound(*_own(slow)).seconds


def _own(run: RunRecord) -> tuple[CellModel, RunShape, Trace]:
    cal = calibrate([run])
    return cal.cell, cal.shape, cal.trace()


def test_workload_bound_holds_for_every_recorded_run() -> None:
    from tools.sim_schedulers import load_records

    for runs in load_records(None).values():
        bound = workload_bound(list(runs.values())).seconds
        assert all(r.wall_s >= bound for r in runs.values())


def test_the_writer_thread_takes_group_writes_off_the_loop() -> None:
    """Written by the loop, a group's 2 s shard holds every decision; on the writer's thread only its
    micro-batches wait: the cells switch meanwhile, half a second saved here."""
    blocking = replace(CELL, group_write_s=2.0)
    writer = replace(blocking, group_write_blocks=False)
    for scheduler in ("colocate_cells", "elastic"):
        assert simulate(scheduler, blocking, SHAPE, two_rollouts()).wall_s == pytest.approx(7.0)
        assert simulate(scheduler, writer, SHAPE, two_rollouts()).wall_s == pytest.approx(6.5)


def test_shared_cpus_stretch_the_harness_engine_and_trainer() -> None:
    """Two sessions with 1 s of their own CPU work each: on CPUs of their own (inf) as written; on one shared
    CPU each piece of CPU work that meets another takes twice as long (the start-up, the second call, the
    second micro-batch), and the run records what contention each met."""
    trace = Trace({0: [Rollout(f"s0-g0-r{i}", 0, (Call(0, 0, 2.0),), 0.0, 1000, cpu_s=1.0) for i in range(2)]})
    alone = simulate("colocate_cells", CELL, SHAPE, trace)
    assert alone.wall_s == pytest.approx(6.0) and alone.train_slowdown == 1.0  # 1 s CPU, 1 s call, 2 s tools
    shared = simulate("colocate_cells", replace(CELL, cpus=1), SHAPE, trace)
    assert shared.wall_s == pytest.approx(9.0)  # start-up 2 s, calls 2 s, the second micro-batch 2 s
    assert shared.cpu_jobs_at_start == {"s0-g0-r0": 2, "s0-g0-r1": 2}
    assert shared.train_slowdown == pytest.approx(1.5)


def test_a_session_splits_into_tool_sleeps_and_its_own_cpu_work() -> None:
    """With the harness's tool sleep known, what is left between and after the calls, and outside the
    harness, is the session's own CPU work; without it, the gaps stay as measured."""
    sess = {"seconds": 9.5, "harness_s": 9.0, "calls": [[10, 5, 1.0, 2.05], [10, 5, 1.0, 4.02], [10, 5, 0.5, 0.3]]}
    sleeps, cpu = split_session(sess, 2.0)
    assert sleeps == [2.0, 4.0, 0.0] and cpu == pytest.approx(0.5 + 0.05 + 0.02 + 0.3)
    assert split_session(sess, None) == ([2.05, 4.02, 0.3], pytest.approx(0.5))


def test_a_predictive_calibration_reproduces_the_runs_it_was_fitted_on() -> None:
    """Costs divided by the contention each session met, then simulated under the same scheduler: the wall
    it was fitted on, within the replay's own error; the shared CPUs come from the runs' records."""
    from tools.sim_schedulers import load_records

    runs = load_records(None)["sigma0.5"]
    elastic = [r for r in runs.values() if r.scheduler == "elastic"]
    cal = calibrate_predictive(elastic)
    assert cal.cell.cpus == 2 and all(r.cpu_s > 0 for r in cal.rollouts.values())
    wall = simulate("elastic", cal.cell, cal.shape, cal.trace()).wall_s
    assert wall == pytest.approx(elastic[0].wall_s, rel=0.05)
