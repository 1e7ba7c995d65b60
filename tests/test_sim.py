"""The scheduler simulator: hand-timed runs, the production policy in the loop, the bound, calibration."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import yaml

from gyre.harness.builtin import rollout_tool_factor
from gyre.sched import policy
from gyre.sim.bound import lower_bound
from gyre.sim.calibrate import Calibration, RunRecord, calibrate, fit_engine_rows, read_run
from gyre.sim.predict import Costs, fit_costs, longer, measured_costs, predict, run_bound, split_gaps, workload_of
from gyre.sim.simulator import simulate
from gyre.sim.what_if import CarryAcrossSteps
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


@pytest.mark.parametrize(
    ("scheduler", "queued", "none"),
    [
        # both cells switch at 3 s and train at once; reduce + sync (0.5 s) with both cells in the training role
        ("colocate_cells", 0.0, 1.0),
        # the core in the training role with nothing to train while the second session waits for the one slot
        # (0.5-3.5) and while it runs (3.5-6.5); the rollout cell's empty slot before admission (0-0.5), while
        # the core trains (6.5-8.5) and during reduce + sync, with the core's (8.5-9)
        ("async", 3.0, 0.5 + 3.0 + 2.0 + 1.0),
    ],
)
def test_idle_cell_seconds_by_hand(scheduler: str, queued: float, none: float) -> None:
    r = simulate(scheduler, CELL, SHAPE, two_rollouts())
    assert r.idle_s == {"sessions_queued": pytest.approx(queued), "none_queued": pytest.approx(none)}


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


def test_a_session_is_graded_outside_its_slot() -> None:
    """Four sessions on two slots (a cell each), each a 1 s call and 2 s of tools, then 2 s of grading: the next
    two take the slots as the first two leave their harnesses (3 s), not once they are graded (5 s)."""
    trace = Trace({0: [Rollout(f"s0-g0-r{i}", 0, (Call(0, 0, 2.0),), 0.0, 1000, end_s=2.0) for i in range(4)]})
    r = simulate("colocate_cells", CELL, replace(SHAPE, group_size=4), trace)
    # harnesses 0-3 and 3-6; nothing serves from 6 (0.5 s switch); graded by 8: 4 micro-batches on 2 cells, 2 s;
    # reduce + sync 0.5 s (graded in the slot: 0-5, 5-10, then the same 2.5 s)
    assert r.wall_s == pytest.approx(10.5)
    assert r.session_s == pytest.approx(4 * 3.0)  # slot-seconds: the harnesses only
    assert lower_bound(CELL, replace(SHAPE, group_size=4), trace).seconds <= r.wall_s


def test_tool_factor_is_the_harness_draw() -> None:
    for rid in ("s0-g0-r0", "s3-g1-r7"):
        assert tool_factor(rid, 0.5) == rollout_tool_factor(rid, 0.5)
    assert tool_factor("x", 0.0) == 1.0


def write_run(d: Path, decodes: tuple[tuple[int, ...], ...] = ((10, 20), (10, 20))) -> None:
    """A cell job's outputs, by hand: 2 sessions of 2 calls (or as many as `decodes` gives each, decoding as
    many tokens), micro-batches of 1000 tokens in 0.5 s."""
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
        # each call alone on engine e{i}: 0.02 s + 0.01 s a token decoded; 1.5 s of tools after
        t = 100.0 + 10 * i
        for dec in decodes[i]:
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
    # the CPU work alone (2 s start-ups, 2 calls of 1 s on engines of one session each, 2 s of training) on 1 CPU
    cpu_bound = lower_bound(replace(CELL, cpus=1), SHAPE, trace).cpu_s
    assert cpu_bound == pytest.approx(6.0) and cpu_bound <= shared.wall_s
    assert lower_bound(CELL, SHAPE, trace).cpu_s == 0.0  # CPUs of their own: no such bound


def test_a_session_splits_into_tool_sleeps_and_the_harness_own_seconds(tmp_path: Path) -> None:
    """Each gap after a call holds a whole number of the rollout's tool sleeps (one per tool call of the
    reply) and the harness's own seconds; the workload keeps the sleeps and takes the rest from the costs."""
    write_run(tmp_path)
    run = read_run(tmp_path)
    run.shape["tool_time_s"], run.shape["tool_time_sigma"] = 0.5, 0.0
    sess = {"seconds": 9.5, "harness_s": 9.0, "calls": [[10, 5, 1.0, 1.02], [10, 5, 1.0, 0.01], [10, 5, 0.5, 0.8]]}
    assert split_gaps(run, "s0-g0-r0", sess) == [
        (1.0, pytest.approx(0.02)),  # two tool calls
        (0.0, pytest.approx(0.01)),  # a reply without a usable tool call: sent again at once
        (0.5, pytest.approx(0.3)),  # the final tool call, then the harness's end
    ]
    run.sessions = {"s0-g0-r0": sess}
    costs = measured_costs([run])
    assert (costs.gap_s, costs.own_s) == (pytest.approx(0.015), pytest.approx(0.5 + 0.3))  # outside, after the last
    (rollout,) = workload_of(run, costs).by_step[0]
    assert [c.tool_s for c in rollout.calls] == [pytest.approx(1.015), pytest.approx(0.015), pytest.approx(0.5)]
    assert [(c.prefill, c.decode) for c in rollout.calls] == [(10, 5)] * 3
    assert (rollout.overhead_s, rollout.cpu_s) == (0.0, pytest.approx(0.8))  # its own work: CPU, as it starts
    assert (costs.grade_s, rollout.end_cpu_s) == (0.0, 0.0)  # graded in its slot (runs from before): in own_s
    sess |= {"seconds": 9.7, "grade_s": 0.2}  # graded outside its slot: CPU work after it, not in own_s
    costs = measured_costs([run])
    (rollout,) = workload_of(run, costs).by_step[0]
    assert (costs.own_s, costs.grade_s) == (pytest.approx(0.8), pytest.approx(0.2))
    assert (rollout.cpu_s, rollout.end_cpu_s) == (pytest.approx(0.8), pytest.approx(0.2))


def test_a_run_is_predicted_from_another_run_costs_on_its_own_workload(tmp_path: Path) -> None:
    """The costs carry the engine, not the sessions: a run whose calls were twice as slow (an engine
    shared with more sessions) predicts the quick run's wall on the quick run's workload all the same
    except for the engine's seconds, and a bound at shared costs is one for both runs."""
    write_run(tmp_path)
    quick = read_run(tmp_path)
    quick.shape["cpus"] = None  # CPUs of its own: the costs as measured
    slow = RunRecord.from_json(quick.to_json())
    slow.scheduler = "colocate_cells"
    slow.calls = [(t, n, d, 2 * s) for t, n, d, s in slow.calls]
    for s in slow.sessions.values():  # the same tokens and tool seconds, every call twice as long
        s["calls"] = [[p, d, 2 * dur, gap] for p, d, dur, gap in s["calls"]]
    costs_quick, costs_slow = fit_costs([quick]), fit_costs([slow])
    assert costs_slow.cell.call_s == pytest.approx(2 * costs_quick.cell.call_s, rel=1e-3)
    assert workload_of(slow, costs_quick).by_step == workload_of(quick, costs_quick).by_step
    engine_s = sum(d for s in quick.sessions.values() for _, _, d, _ in s["calls"]) / 2  # a session per cell
    assert predict(costs_slow, quick).wall_s == pytest.approx(predict(costs_quick, quick).wall_s + engine_s, rel=0.02)
    shared = fit_costs([quick, slow])
    assert run_bound(shared, quick) == pytest.approx(run_bound(shared, slow))
    assert run_bound(shared, quick) < lower_bound(*_own(slow)).seconds


def test_the_engine_fit_adds_up_to_the_seconds_measured() -> None:
    """Calls a replay put at slowdowns 1 and 3 that all took 0.3 s (the replay's contention is not the calls'):
    the fit's fixed cost is the ratio of the sums (6 s over slowdowns adding up to 40: 0.15 s), so the fitted calls
    add up to the 6 s measured (unweighted least squares, sum(s y) / sum(s^2) = 0.12 s, fitted them 4.8 s); calls
    that do follow the model give its costs back."""
    rows = [(s, 0.0, 1.0, 0.3) for s in (1.0, 3.0) for _ in range(10)]
    call_s, per_token, shared = fit_engine_rows(rows)
    assert (call_s, per_token, shared) == (pytest.approx(0.15), 0.0, 0.0)
    assert sum(s * call_s for s, *_ in rows) == pytest.approx(6.0)
    exact = [
        (s, dec, n, s * (0.02 + dec * (0.004 + 0.001 * (n - 1)))) for s in (1.0, 2.5) for dec in (5, 40) for n in (1, 3)
    ]
    assert fit_engine_rows(exact) == pytest.approx((0.02, 0.004, 0.001))


@pytest.mark.parametrize("cpus", [1, 2])
def test_costs_fitted_from_a_simulated_run_are_the_costs_it_ran_at(tmp_path: Path, cpus: int) -> None:
    """A run made by the simulator at known costs on shared CPUs (two sessions of 4 calls, each call's and
    session's seconds as long as its contention made them): the costs fitted from it are those costs alone
    on a CPU, where the costs as measured are slower; on its own CPUs the run is as measured."""
    write_run(tmp_path)  # the switches, micro-batches and steps of a hand-made run
    run = read_run(tmp_path)
    run.scheduler = "colocate_cells"
    run.shape.update(cpus=cpus, tool_time_s=1.5, tool_time_sigma=0.0)
    for i, sess in enumerate(run.sessions.values()):  # 4 calls of 10-40 tokens (and 5-20), 1.5 s sleeps after each
        sess["calls"] = [[10, 10 * (k + 1) // (i + 1), 0.0, 1.5] for k in range(4)]
    truth = Costs(replace(measured_costs([run]).cell, call_s=0.05, session_tps=50.0, decode_tps=1e9), 0.0, 0.4, 0.3)
    made = predict(truth, run)
    cell = replace(truth.cell, cpus=cpus)
    for rid, sess in run.sessions.items():
        for k, call in enumerate(sess["calls"]):
            per_cell, jobs = made.call_contention[(rid, k)]
            call[2] = cell.call_seconds(Call(0, call[1], 0.0), per_cell) * cell.slowdown(jobs)
        sess["harness_s"] = sum(c[2] + c[3] for c in sess["calls"])
        sess["grade_s"] = truth.grade_s * cell.slowdown(made.cpu_jobs_at_end[rid])
        sess["seconds"] = sess["harness_s"] + truth.own_s * cell.slowdown(made.cpu_jobs_at_start[rid]) + sess["grade_s"]
    run.micro_batches = [(t, t / truth.cell.train_tps * made.train_slowdown, f) for t, _, f in run.micro_batches]
    run.calls = [(0.0, 1, c[1], c[2]) for s in run.sessions.values() for c in s["calls"]]  # a session a cell
    measured, fitted = measured_costs([run]), fit_costs([run])
    assert fitted.cell.call_s == pytest.approx(0.05, rel=0.05)
    assert fitted.cell.session_tps == pytest.approx(50.0, rel=0.05)
    assert fitted.own_s == pytest.approx(0.4, rel=0.05) and fitted.gap_s == 0.0
    # grading: the first round replays at the costs as measured, where one session is graded alone (0.45 s); the
    # rounds' fits are averaged (ROUNDS), so one of six is off by half: 0.325 s on one CPU
    assert fitted.grade_s == pytest.approx(0.3, rel=0.1)
    assert fitted.cell.train_tps == pytest.approx(truth.cell.train_tps, rel=0.05)
    assert predict(fitted, run).wall_s == pytest.approx(made.wall_s, rel=0.02)
    if cpus == 1:  # 2 sessions' work on 1 CPU: as measured, slower than alone
        call = Call(0, 20, 0.0)
        assert measured.cell.call_seconds(call, 1) > 1.1 * truth.cell.call_seconds(call, 1)
        assert measured.own_s == pytest.approx(2 * truth.own_s)
    run.shape["cpus"] = None
    assert fit_costs([run]) == measured


def _own(run: RunRecord) -> tuple[CellModel, RunShape, Trace]:
    cal = calibrate([run])
    return cal.cell, cal.shape, cal.trace()


# the recorded same-work benchmark (tools/sim_data/bench30_runs.json.gz: tools/bench_schedulers.py, 3 repeats
# interleaved of each scheduler, 6 steps; disjoint2 at tails sigma 0.5 and 1.0 and training ~ rollouts, shared3
# at sigma 0.5), predicted by `python -m tools.sim_schedulers --cross` at costs alone on a CPU: 1b median 3.4%,
# worst 12.3%; 1c median 2.9%, worst 17.6% (docs/benchmarks.md). Issue 29 asks for 10% and 20%. Costs as measured
# (the source scheduler's contention in them) erred 12.3% / 78.1% and 11.1% / 65.1%
MEDIAN_BOUND = 0.10
WORST_BOUND = 0.20


def test_cross_prediction_of_the_recorded_benchmark() -> None:
    """Costs from one scheduler's runs alone predict every other run of the workload, and costs from one
    workload's runs of one scheduler every run of the other workloads and layouts."""
    from tools.sim_schedulers import SCHEDULERS, cross_predict, held_out, load_records, scheduler_costs

    records = load_records(None, "same-work")
    assert set(records) == {"disjoint2/sigma0.5", "disjoint2/sigma1.0", "disjoint2/trainheavy", "shared3/sigma0.5"}
    fitted = scheduler_costs(records)  # each scheduler's costs on each workload, for both
    cross, held = cross_predict(records, fitted), held_out(records, fitted)
    for rows in cross["table"].values():
        assert set(rows) == set(SCHEDULERS) and all(set(r) == set(SCHEDULERS) for r in rows.values())
    assert cross["predictions"] == 4 * 3 * 6  # each of 9 runs of a workload from the 2 schedulers not its own
    assert held["predictions"] == 4 * 3 * 27  # each calibration: every run of the 3 other workloads
    for result in (cross, held):
        assert result["median_error"] <= MEDIAN_BOUND and result["worst_error"] <= WORST_BOUND


def test_cross_prediction_of_the_benchmark_recorded_again() -> None:
    """tools/sim_data/bench32_runs.json.gz (`--data same-work-2`: the same command recorded with this code, since
    sessions free their slot before grading): over disjoint2's two tails and shared3 (three workloads, two layouts)
    within issue 29's bounds (measured: 1b 3.3% / 12.3%, 1c 2.8% / 13.5%). With the fourth, training ~ rollouts
    (CPU-bound: 79-86% of both CPUs), every prediction beyond the worst bound has it as its target, and its own
    repeats differ by more than that on identical work (up to 23.4%: the machine, not the schedule)."""
    from tools.sim_schedulers import cross_predict, held_out, load_records, repeat_noise, scheduler_costs

    records = load_records(None, "same-work-2")
    heavy = "disjoint2/trainheavy"
    assert set(records) == {"disjoint2/sigma0.5", "disjoint2/sigma1.0", heavy, "shared3/sigma0.5"}
    fitted = scheduler_costs(records)
    tails = {wl: runs for wl, runs in records.items() if wl != heavy}
    cross, held = cross_predict(tails, fitted), held_out(tails, fitted)
    assert cross["predictions"] == 3 * 3 * 6 and held["predictions"] == 3 * 3 * 18
    for result in (cross, held):
        assert result["median_error"] <= MEDIAN_BOUND and result["worst_error"] <= WORST_BOUND

    def worse(r: dict) -> bool:
        return max(abs(e) for e in r["errors"]) > WORST_BOUND

    every = cross_predict(records, fitted)["table"]
    beyond = {
        wl for wl, rows in every.items() for src, row in rows.items() for s, r in row.items() if s != src and worse(r)
    }
    every = held_out(records, fitted)["table"]
    beyond |= {wl for rows in every.values() for row in rows.values() for wl, r in row.items() if worse(r)}
    assert beyond == {heavy}
    noise = repeat_noise({heavy: records[heavy]})
    assert noise is not None and noise["worst_error"] > WORST_BOUND


def test_cross_prediction_of_the_benchmark_recorded_since_sandboxes_start_without_a_fork() -> None:
    """tools/sim_data/bench38_runs.json.gz (`--data same-work-4`, the code as it is: the controller's CPU 13 -> 9 s
    a run): every scheduler from each other's costs and every workload and layout from each other's within issue
    29's bounds, the CPU-bound training ~ rollouts too (measured 1b 1.4% / 15.8%, 1c 1.8% / 12.8%; with the engine
    fitted unweighted, 2.2% / 20.3%: elastic there from colocate_cells' costs); on the three tails alone 1b 1.0% /
    3.9%, 1c 1.6% / 6.2%."""
    from tools.sim_schedulers import cross_predict, held_out, load_records, scheduler_costs

    records = load_records(None, "same-work-4")
    heavy = "disjoint2/trainheavy"
    assert set(records) == {"disjoint2/sigma0.5", "disjoint2/sigma1.0", heavy, "shared3/sigma0.5"}
    fitted = scheduler_costs(records)
    cross, held = cross_predict(records, fitted), held_out(records, fitted)
    assert cross["predictions"] == 4 * 3 * 6 and held["predictions"] == 4 * 3 * 27
    for result in (cross, held):
        assert result["median_error"] <= MEDIAN_BOUND and result["worst_error"] <= WORST_BOUND, result
    tails = {wl: runs for wl, runs in records.items() if wl != heavy}
    for result in (cross_predict(tails, fitted), held_out(tails, fitted)):
        assert result["median_error"] <= 0.05 and result["worst_error"] <= 0.10, result


def test_costs_from_runs_of_six_steps_predict_runs_of_twelve() -> None:
    """`--data same-work-12 --cross --fit-from same-work-2`: each scheduler's costs fitted from its 6-step runs of
    a tail (bench32) predict every 12-step run of every scheduler on that tail (bench33, recorded hours later with
    the same code), and on the other tail (1c), within issue 29's bounds; none of these runs was fitted (measured:
    1b 1.7% / 9.8%, 1c 1.5% / 11.3%, 54 predictions each)."""
    from tools.sim_schedulers import cross_predict, held_out, load_records, scheduler_costs

    six, twelve = load_records(None, "same-work-2"), load_records(None, "same-work-12")
    assert set(twelve) == {"disjoint2/sigma0.5", "disjoint2/sigma1.0"}
    assert {r.shape["steps"] for wl in twelve for r in six[wl].values()} == {6}
    assert {r.shape["steps"] for runs in twelve.values() for r in runs.values()} == {12}
    fitted = scheduler_costs({wl: six[wl] for wl in twelve})
    cross, held = cross_predict(twelve, fitted, "same-work-2"), held_out(twelve, fitted, "same-work-2")
    assert cross["predictions"] == 2 * 3 * 9 and held["predictions"] == 2 * 3 * 9
    for result in (cross, held):
        assert result["median_error"] <= MEDIAN_BOUND and result["worst_error"] <= WORST_BOUND, result


def test_every_recorded_run_is_above_its_bound() -> None:
    from tools.sim_schedulers import load_records

    for runs in load_records(None, "learning").values():
        costs = fit_costs(list(runs.values()))
        assert all(r.wall_s >= run_bound(costs, r) for r in runs.values())


def test_the_same_work_benchmark_ran_the_same_sessions_under_every_scheduler() -> None:
    """tools/sim_data/bench30_runs.json.gz, recorded by tools/bench_schedulers.py's default (a frozen policy,
    each call sampled from its rollout's and prompt's seed): every session of every colocate_cells and async run
    made as many calls as in the workload's first run, each sampling as many tokens (what a record keeps of
    them: the sampled tokens themselves matched too, bench_schedulers' `same_work`); elastic reroutes sessions, and a
    prefix recomputed on another engine can differ in the last bits and flip a sampled token (3-17 of 192
    rollouts a run there, the most where it switches most: training ~ rollouts), so a few of its sessions go
    their own way; without the seeds nearly every session would. Every run is above its bound."""
    from tools.sim_schedulers import load_records

    records = load_records(None, "same-work")
    assert set(records) == {"disjoint2/sigma0.5", "disjoint2/sigma1.0", "disjoint2/trainheavy", "shared3/sigma0.5"}
    for wl, runs in records.items():
        calls = {name: {rid: [c[1] for c in s["calls"]] for rid, s in r.sessions.items()} for name, r in runs.items()}
        first = calls[min(n for n in runs if not n.startswith("elastic"))]
        for name, sessions in calls.items():
            differ = [rid for rid in first if sessions.get(rid) != first[rid]]
            assert len(sessions) == len(first) == 6 * 32, (wl, name)
            assert len(differ) <= (len(first) // 10 if name.startswith("elastic") else 0), (wl, name, differ)
        costs = fit_costs(list(runs.values()))
        assert all(r.wall_s >= run_bound(costs, r) for r in runs.values()), wl


def test_a_benchmarks_records_keep_the_cpu_seconds_it_measured(tmp_path: Path) -> None:
    """bench_schedulers' CPU seconds by component go with each run's record (results.json, or progress.json of
    a benchmark stopped early); the recorded bench32 has them for every run, bench30 (recorded before) none."""
    from tools.sim_schedulers import _measured_cpu, load_records

    run = {"out": str(tmp_path / "elastic-0"), "cpu_s": {"controller": 18.4, "harnesses": 34.7}}
    (tmp_path / "progress.json").write_text(json.dumps({"elastic": [run], "async": []}))
    assert _measured_cpu(tmp_path) == {"elastic-0": run["cpu_s"]}
    (tmp_path / "results.json").write_text(json.dumps({"runs": {"elastic": [{**run, "cpu_s": {"controller": 1.0}}]}}))
    assert _measured_cpu(tmp_path) == {"elastic-0": {"controller": 1.0}}  # the finished benchmark's own
    assert _measured_cpu(tmp_path / "elsewhere") == {}
    fresh = load_records(None, "same-work-2")
    assert all(
        r.cpu_s.get("controller", 0) > 0 and r.cpu_s.get("harnesses", 0) > 0
        for rs in fresh.values()
        for r in rs.values()
    )
    assert all(not r.cpu_s for rs in load_records(None, "same-work").values() for r in rs.values())


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], saved: Path | None = None) -> str:
    """tools.sim_schedulers run with `argv`: it exits 2 (argparse's refusal); what it said. With `saved`, the
    file --save-data would store over is that one, never the project's recorded benchmark."""
    from tools import sim_schedulers

    with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as stop:
        mp.setattr(sys, "argv", ["sim_schedulers", *argv])
        if saved is not None:
            mp.setitem(sim_schedulers.RECORDED, "same-work", saved)
        sim_schedulers.main()
    assert stop.value.code == 2
    return capsys.readouterr().err


def test_workloads_the_benchmark_lacks_save_data_with_workloads_and_parts_together_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "saved.json.gz"
    err = _refused(["--cross", "--out", str(tmp_path), "--workloads", "disjoint2/sigma0.5,disjoint2/sigma9"], capsys)
    assert "--workloads: no disjoint2/sigma9 in this benchmark" in err and "disjoint2/trainheavy" in err
    assert not list(tmp_path.iterdir())  # refused before anything was computed
    err = _refused(["--bench", str(tmp_path), "--save-data", "--workloads", "disjoint2/sigma0.5"], capsys, saved)
    assert "--save-data stores every workload" in err and not saved.exists()
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "summary.json").write_text("{}")  # a run directory's file, not under a run's name
    err = _refused(["--bench", str(tmp_path), "--save-data", "--data", "same-work"], capsys, saved)
    assert "holds no run of tools/bench_schedulers.py" in err and not saved.exists()
    (tmp_path / "x" / "summary.json").unlink()
    (tmp_path / "x").rmdir()
    for argv in (["--carry", "--free-cpus"], ["--quick", "--free-cpus"]):  # one part only; --quick shortens others
        assert "--free-cpus" in _refused(["--out", str(tmp_path), *argv], capsys)
    assert "--admission" in _refused(["--out", str(tmp_path), "--quick", "--admission"], capsys)
    assert "--steps" in _refused(["--out", str(tmp_path), "--quick", "--steps", "12"], capsys)
    assert "(--cross)" in _refused(["--out", str(tmp_path), "--fit-from", "same-work-2"], capsys)
    assert "other than the one predicted" in _refused(
        ["--out", str(tmp_path), "--cross", "--fit-from", "same-work"], capsys
    )
    assert "whole numbers" in _refused(["--out", str(tmp_path), "--steps", "12,x"], capsys)
    assert "at least 1" in _refused(["--out", str(tmp_path), "--steps", "12,0"], capsys)
    assert "--capacity: each number must be at least 1" in _refused(["--out", str(tmp_path), "--capacity", "0"], capsys)
    assert not list(tmp_path.iterdir())


def test_capacity_sweep_changes_every_schedulers_capacity_and_keeps_the_runs_own() -> None:
    """`--capacity`: at each run's own capacity (6 at disjoint2) the same walls as 1d's same work; fewer sessions
    per cell take every scheduler longer, and no run's workload is changed otherwise."""
    from tools.sim_schedulers import SCHEDULERS, capacity_sweep, load_records, workload_bounds

    records = {"disjoint2/sigma0.5": load_records(None, "same-work")["disjoint2/sigma0.5"]}
    assert {r.shape["capacity"] for r in records["disjoint2/sigma0.5"].values()} == {6}
    sweep = capacity_sweep(records, [4, 6])["disjoint2/sigma0.5"]
    own = workload_bounds(records)["disjoint2/sigma0.5"]
    # the same simulations: only the rounding differs (1d keeps 2 decimals, 1f 1)
    assert all(abs(sweep[6]["same_work_s"][s] - own[s]["same_work_s"]) <= 0.051 for s in SCHEDULERS), (sweep, own)
    assert sweep[6]["over_bound"] == own["same_work_over_bound"]
    assert all(sweep[4]["same_work_s"][s] > sweep[6]["same_work_s"][s] for s in SCHEDULERS), sweep


def test_free_cpus_take_the_contention_away_and_nothing_else(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--free-cpus` (1h): every scheduler on every run's workload on its CPUs (1d's walls) and with a CPU per
    job, which no scheduler runs slower on; elastic's cell-seconds of no work are split by whether sessions queued."""
    from tools import sim_schedulers

    records = {"disjoint2/sigma0.5": sim_schedulers.load_records(None, "same-work-2")["disjoint2/sigma0.5"]}
    table = sim_schedulers.free_cpus(records)["disjoint2/sigma0.5"]
    own = sim_schedulers.workload_bounds(records)["disjoint2/sigma0.5"]
    for s in sim_schedulers.SCHEDULERS:
        assert abs(table["shared"]["same_work_s"][s] - own[s]["same_work_s"]) <= 0.051  # 1 decimal against 2
        assert table["free"]["same_work_s"][s] < table["shared"]["same_work_s"][s]
    assert set(table["elastic_idle_cell_s"]) == {"sessions_queued", "none_queued", "switching"}
    assert all(records["disjoint2/sigma0.5"][n].shape["cpus"] == 2 for n in records["disjoint2/sigma0.5"])
    assert "1h. Every scheduler on the same work" in _one_part("--free-cpus", tmp_path, capsys)
    assert json.loads((tmp_path / "free_cpus.json").read_text())["disjoint2/sigma0.5"] == table


def _one_part(option: str, out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """What tools.sim_schedulers prints with `option` on same-work-2's disjoint2 sigma 0.5 runs (writing to `out`)."""
    from tools import sim_schedulers

    argv = ["sim_schedulers", "--data", "same-work-2", "--workloads", "disjoint2/sigma0.5", option]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", [*argv, "--out", str(out)])
        sim_schedulers.main()
    return capsys.readouterr().out


def test_admission_rules_keep_the_recorded_order_and_put_the_longest_looking_group_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--admission` (1j): under fifo, the order the recorded runs admitted in, 1d's walls; under group_length
    (the default since) elastic takes less time on the recorded tail, and every scheduler's walls are printed
    and stored."""
    from tools import sim_schedulers

    records = {"disjoint2/sigma0.5": sim_schedulers.load_records(None, "same-work-2")["disjoint2/sigma0.5"]}
    table = sim_schedulers.admission_rules(records)["disjoint2/sigma0.5"]
    own = sim_schedulers.workload_bounds(records)["disjoint2/sigma0.5"]
    assert set(table) == {"fifo", "group_length"}
    for s in sim_schedulers.SCHEDULERS:
        assert abs(table["fifo"]["same_work_s"][s] - own[s]["same_work_s"]) <= 0.051  # 1 decimal against 2
    assert table["group_length"]["same_work_s"]["elastic"] < 0.95 * table["fifo"]["same_work_s"]["elastic"], table
    assert "1j. Which queued session takes a freed slot" in _one_part("--admission", tmp_path, capsys)
    assert json.loads((tmp_path / "admission.json").read_text())["disjoint2/sigma0.5"] == table


def test_a_longer_run_keeps_the_steps_recorded_and_draws_the_others_from_its_sessions() -> None:
    """gyre.sim.predict.longer: the recorded steps unchanged, each further step as many sessions as a recorded
    one, none twice in a step, named and grouped as a run's (groups of group_size in order), the same each time."""
    calls = {
        f"s{st}-g{g}-r{i}": (Call(st, g, float(10 * st + 2 * g + i)),) for st in (0, 1) for g in (0, 1) for i in (0, 1)
    }
    trace = Trace(
        {st: [Rollout(rid, int(rid[4]), c) for rid, c in calls.items() if rid.startswith(f"s{st}")] for st in (0, 1)}
    )
    made = longer(trace, 5, group_size=2)
    assert sorted(made.by_step) == [0, 1, 2, 3, 4]
    assert made.by_step[0] == trace.by_step[0] and made.by_step[1] == trace.by_step[1]
    for step in (2, 3, 4):
        drawn = made.by_step[step]
        assert [(r.rollout_id, r.group) for r in drawn] == [(f"s{step}-g{i // 2}-r{i % 2}", i // 2) for i in range(4)]
        assert len({r.calls for r in drawn}) == 4 and {r.calls for r in drawn} <= set(calls.values())
    assert made.by_step[2] != made.by_step[3] or made.by_step[3] != made.by_step[4]  # seeded by the step
    assert longer(trace, 5, group_size=2) == made
    assert sorted(longer(trace, 1, group_size=2).by_step) == [0]


def test_longer_runs_keep_the_recorded_run_and_take_longer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--steps` (1i): at the recorded length the walls and bound of 1h; a run made twice as long takes every
    scheduler and the bound longer, each by at most about twice (the pipeline's start is paid once)."""
    from tools import sim_schedulers

    runs = sim_schedulers.load_records(None, "same-work-2")["disjoint2/sigma0.5"]
    records = {"disjoint2/sigma0.5": {n: r for n, r in runs.items() if n.endswith("-0")}}  # a run of each
    run = records["disjoint2/sigma0.5"]["elastic-0"]
    costs = fit_costs(list(records["disjoint2/sigma0.5"].values()))
    assert predict(costs, run, "elastic", run.shape["steps"]).wall_s == predict(costs, run, "elastic").wall_s
    assert run_bound(costs, run, run.shape["steps"]) == run_bound(costs, run)
    argv = ["sim_schedulers", "--workloads", "disjoint2/sigma0.5", "--steps", "12", "--out", str(tmp_path)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", argv)
        mp.setattr(sim_schedulers, "load_records", lambda bench, data: records)
        sim_schedulers.main()
    assert "1i. Every scheduler on the same work made longer" in capsys.readouterr().out
    table = json.loads((tmp_path / "longer_runs.json").read_text())["disjoint2/sigma0.5"]
    assert sorted(table) == ["12", "6"]
    h = sim_schedulers.free_cpus(records)["disjoint2/sigma0.5"]
    for where in ("shared", "free"):
        assert {k: v for k, v in table["6"][where].items() if k != "ceiling"} == h[where]
        # each baseline's wall over the bound: never below elastic's speedup over it
        assert all(table["6"][where]["ceiling"][s] >= v for s, v in table["6"][where]["speedup"].items())
        for s in sim_schedulers.SCHEDULERS:
            six, twelve = table["6"][where]["same_work_s"][s], table["12"][where]["same_work_s"][s]
            assert 1.5 * six < twelve < 2.3 * six, (where, s, six, twelve)


def test_carried_groups_train_once_in_the_oldest_open_step() -> None:
    """What-if (gyre.sim.what_if): step 0's slow group no longer holds its update back; a fast group of step 1
    takes its place and the slow one trains in step 1: the same micro-batches, step 0 done sooner."""
    tools = {(0, 0): 1.0, (0, 1): 10.0, (1, 0): 1.0, (1, 1): 1.0}
    trace = Trace({s: [Rollout(f"s{s}-g{g}-r0", g, (Call(0, 0, tools[s, g]),), 0.0, 1000) for g in (0, 1)]
                   for s in (0, 1)})  # fmt: skip
    shape = RunShape(steps=2, groups_per_step=2, group_size=1, n_cells=2, staleness=1, micro_batch_tokens=1000)
    built = simulate("elastic", CELL, shape, trace)
    carrying = CarryAcrossSteps("elastic", CELL, shape, trace).run()
    assert carrying.train_busy_s == pytest.approx(built.train_busy_s) == 4.0  # 4 micro-batches of 1 s, once each
    assert carrying.step_end_s[0] < built.step_end_s[0] - 5.0  # not behind the 10 s tool call
    assert carrying.wall_s <= built.wall_s
