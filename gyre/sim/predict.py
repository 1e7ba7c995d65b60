"""Predicting a run the model has not seen: the workload from the run, every cost from other runs.

A run's records mix two things. What no scheduler changes is the workload: each session's calls (the
prompt tokens its engine computes, the tokens it decodes) and the harness's tool sleeps after them (the
built-in harness sleeps `tasks.tool_time_s` x the rollout's seeded factor per tool call,
gyre.harness.builtin). It is not the same for two runs of one workload: the policy decides how many tool
calls a reply makes and when a session finishes, and a learning policy's samples differ between runs (357-585
tool sleeps in runs of 6 steps of one workload on the same seeds; tools/bench_schedulers.py freezes the
policy and seeds the calls so that they do not). What the scheduler changes is
everything else: how long each call takes on an engine shared with other sessions, the harness's own CPU
work around the sleeps, queueing for session capacity, switches, training, shard writes.

`Costs` is fitted from one set of runs (one scheduler's, one workload's, one layout's): the engine's
per-call and per-token costs, training, switches, steps, the harness's own seconds per tool gap and its
own work outside calls and sleeps (sandbox start-up, the final tool, grading). On one machine every
engine, trainer and harness shares the same CPUs, and what a cost measures depends on what else ran: under
async one cell serves while its trainer's CPU takes the harnesses' work, and its engine decoded a call
1.6-2x as fast as under colocate_cells on the same work. So `fit_costs` fits each cost as it would be
alone on a CPU: it replays the runs under their own scheduler with the simulator's shared CPUs
(`CellModel.cpus`: every CPU job, a busy engine, a training micro-batch, a session in its own work, runs
at cpus / jobs of a CPU when jobs outnumber them), divides each call's, micro-batch's and session's
measured seconds by the slowdown its replay met, and replays again at the costs so fitted (`ROUNDS`
rounds, their fits averaged). `predict` simulates any scheduler on another run's workload (`workload_of`: only its calls' tokens
and its tool sleeps) and shape, on that run's CPUs, at those costs: the test of a model that predicts,
since nothing the target scheduler did enters it, and the contention is the target's own, on its layout.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, replace
from typing import Any

from gyre.sim.bound import lower_bound
from gyre.sim.calibrate import RunRecord, calibrate, fit_engine_rows, run_shape
from gyre.sim.simulator import SimResult, simulate
from gyre.sim.workload import Call, CellModel, Rollout, RunShape, Trace, tool_factor


@dataclass(frozen=True)
class Costs:
    """What runs say about the machine and the harness, apart from the workload: each cost alone on a CPU
    (`fit_costs`), or as the runs met it (`measured_costs`)."""

    cell: CellModel  # engine, training, switch and step costs (capacity and CPUs are the target's)
    gap_s: float  # the harness's own seconds between a call and the next, beyond its tool sleeps
    own_s: float  # a session's own work outside calls and tool sleeps in its slot: start-up, the final tool's
    grade_s: float = 0.0  # its work after its harness, outside its slot: grading (0: runs that graded in the slot)


ROUNDS = 6  # replays of the fitted costs: from 4 on, the recorded benchmark's cross-prediction moves within a point


def cpus_of(run: RunRecord) -> float:
    """The CPUs the run's harnesses, engines and trainers shared (inf: each had its own)."""
    return float(run.shape.get("cpus") or math.inf)


def sleep_of(run: RunRecord, rollout_id: str) -> float:
    """The harness's tool sleep per tool call of this rollout (0 when its run slept none)."""
    tool_s = run.shape.get("tool_time_s") or 0.0
    return tool_s * tool_factor(rollout_id, run.shape.get("tool_time_sigma", 0.0)) if tool_s else 0.0


def split_gaps(run: RunRecord, rollout_id: str, session: dict[str, Any]) -> list[tuple[float, float]]:
    """Each gap after a call as (tool sleeps, the rest): a gap holds a whole number of sleeps (one per tool
    call of the reply: a sleep never ends early) and the harness's own work around them."""
    sleep = sleep_of(run, rollout_id)
    out = []
    for *_, gap in session["calls"]:
        slept = math.floor((gap + 1e-3) / sleep) * sleep if sleep else 0.0  # 1 ms: the records' rounding
        out.append((slept, max(0.0, gap - slept)))
    return out


def own_seconds(run: RunRecord, rollout_id: str, session: dict[str, Any]) -> float:
    """A session's measured seconds in its slot outside its calls and tool sleeps, but for the gaps between
    calls: outside the harness (sandbox start-up; grading too in runs that graded in the slot) and after its
    last call beyond the sleeps."""
    last = split_gaps(run, rollout_id, session)[-1][1] if session["calls"] else 0.0
    return max(0.0, session["seconds"] - session["harness_s"] - session.get("grade_s", 0.0)) + last


def measured_costs(runs: list[RunRecord]) -> Costs:
    """The costs as `runs` met them, the contention of their schedules in them: medians over their sessions,
    the engine fitted on the calls in flight on it (gyre.sim.calibrate.fit_cell)."""
    if not runs:
        raise ValueError("fitting costs needs at least one run")
    gaps = [rest for run in runs for rid, s in run.sessions.items() for _, rest in split_gaps(run, rid, s)[:-1]]
    own = [own_seconds(run, rid, s) for run in runs for rid, s in run.sessions.items()]
    grade = [s.get("grade_s", 0.0) for run in runs for s in run.sessions.values()]
    return Costs(calibrate(runs).cell, _median(gaps), _median(own), _median(grade))


def fit_costs(runs: list[RunRecord], rounds: int = ROUNDS) -> Costs:
    """The costs of `runs` (any schedulers of one machine and harness) alone on a CPU: each round replays
    every run under its own scheduler at the costs so far, on the run's CPUs, and divides each measured
    call's, micro-batch's and session's seconds by the slowdown its replay met; the rounds' fits are
    averaged (a replay's order of events jumps with small changes). Runs whose cells each had their own
    CPUs are their measured costs."""
    measured = costs = measured_costs(runs)
    if all(cpus_of(r) == math.inf for r in runs):
        return measured
    fits: list[Costs] = []
    for _ in range(rounds):
        fits.append(_divide_contention(runs, measured, costs, [predict(costs, r) for r in runs]))
        costs = _mean(fits)
    return costs


def _divide_contention(runs: list[RunRecord], measured: Costs, costs: Costs, replays: list[SimResult]) -> Costs:
    """Each measured cost divided by the slowdown its replay (at `costs`) met on the run's CPUs."""
    engine: list[tuple[float, float, float, float]] = []  # (slowdown, decode tokens, calls on its cell, seconds)
    own: list[float] = []
    grade: list[float] = []
    for run, replay in zip(runs, replays, strict=True):
        cell = replace(costs.cell, cpus=cpus_of(run))
        for rid, sess in run.sessions.items():
            own.append(own_seconds(run, rid, sess) / cell.slowdown(replay.cpu_jobs_at_start.get(rid, 1.0)))
            grade.append(sess.get("grade_s", 0.0) / cell.slowdown(replay.cpu_jobs_at_end.get(rid, 1.0)))
            for i, (_, decode, seconds, _) in enumerate(sess["calls"]):
                per_cell, jobs = replay.call_contention.get((rid, i), (1.0, 1.0))
                engine.append((cell.slowdown(jobs), float(decode), per_cell, seconds))
    call_s, per_token, per_token_shared = fit_engine_rows(engine)
    cell = replace(
        costs.cell,
        call_s=call_s,
        session_tps=1.0 / per_token if per_token > 0 else 1e9,
        decode_tps=1.0 / per_token_shared if per_token_shared > 0 else 1e9,
        train_tps=measured.cell.train_tps * statistics.fmean(r.train_slowdown for r in replays),
    )
    return replace(costs, cell=cell, own_s=_median(own), grade_s=_median(grade))


def _mean(fits: list[Costs]) -> Costs:
    rates = ("call_s", "session_tps", "decode_tps", "train_tps")
    cell = replace(fits[0].cell, **{k: statistics.fmean(getattr(f.cell, k) for f in fits) for k in rates})
    own, grade = (statistics.fmean(getattr(f, k) for f in fits) for k in ("own_s", "grade_s"))
    return replace(fits[0], cell=cell, own_s=own, grade_s=grade)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def workload_of(run: RunRecord, costs: Costs) -> Trace:
    """The run's workload (its sessions' tokens and tool sleeps) with the harness's own seconds of `costs`:
    each gap's after its sleeps, and its work outside calls and sleeps as CPU work when the session starts."""
    shape = run_shape(run)
    tokens = statistics.median(run.step_tokens) / (shape.groups_per_step * shape.group_size) if run.step_tokens else 0
    by_step: dict[int, list[Rollout]] = {}
    for rid, sess in sorted(run.sessions.items()):
        parts = split_gaps(run, rid, sess)
        calls = tuple(
            Call(int(p), int(d), slept + (0.0 if i == len(parts) - 1 else costs.gap_s))
            for i, ((p, d, *_), (slept, _)) in enumerate(zip(sess["calls"], parts, strict=True))
        )
        step, group = int(rid[1:].split("-")[0]), int(rid.split("-")[1][1:])
        rollout = Rollout(rid, group, calls, 0.0, round(tokens), cpu_s=costs.own_s, end_cpu_s=costs.grade_s)
        by_step.setdefault(step, []).append(rollout)
    return Trace(by_step)


def at_run(costs: Costs, run: RunRecord) -> CellModel:
    """The cell model of `costs` on the run's machine: its session capacity, its shared CPUs."""
    return replace(costs.cell, capacity=run.shape["capacity"], cpus=cpus_of(run))


def predict(costs: Costs, target: RunRecord, scheduler: str | None = None, steps: int | None = None) -> SimResult:
    """`scheduler` (the target's own by default) on the target run's workload, shape and CPUs, at `costs`;
    with `steps`, on the run made that long (`longer`)."""
    shape, trace = _work(costs, target, steps)
    return simulate(scheduler or target.scheduler, at_run(costs, target), shape, trace)


def run_bound(costs: Costs, run: RunRecord, steps: int | None = None) -> float:
    """The lower bound (gyre.sim.bound) on the run's own workload, shape and CPUs, at `costs` (each alone on a
    CPU: no schedule makes them faster); with `steps`, on the run made that long (`longer`)."""
    return lower_bound(at_run(costs, run), *_work(costs, run, steps)).seconds


def longer(trace: Trace, steps: int, group_size: int) -> Trace:
    """The trace run for `steps` steps: each step it lacks draws as many sessions as its first step holds
    from all its recorded ones (seeded by the step, without repeats in a step, grouped in order): a longer run
    of the same work, where the pipeline's first and last steps weigh less than in the run recorded."""
    pool = [r for step in sorted(trace.by_step) for r in trace.by_step[step]]
    n = len(trace.by_step[min(trace.by_step)])
    by_step = {s: rs for s, rs in trace.by_step.items() if s < steps}
    for step in range(steps):
        if step not in by_step:
            drawn = random.Random(f"longer:{step}").sample(pool, n)
            by_step[step] = [
                replace(r, rollout_id=f"s{step}-g{i // group_size}-r{i % group_size}", group=i // group_size)
                for i, r in enumerate(drawn)
            ]
    return Trace(by_step)


def _work(costs: Costs, run: RunRecord, steps: int | None) -> tuple[RunShape, Trace]:
    shape, trace = run_shape(run), workload_of(run, costs)
    if steps is None:
        return shape, trace
    return replace(shape, steps=steps), longer(trace, steps, shape.group_size)
