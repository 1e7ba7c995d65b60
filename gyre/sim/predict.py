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
per-call and per-token costs, training, switches, steps, and the harness's own seconds per tool gap, after
the last call and outside the harness (start-up, grading). `predict` simulates any scheduler on another
run's workload (`workload_of`: only its calls' tokens and its tool sleeps) and shape with those costs:
the test of a model that predicts, since nothing the target scheduler did enters it. Costs fitted on one
layout of a machine move to another by the CPU share (`at_sharing`): where 3 cells share 2 CPUs a cell's
engine and trainer run at 2/3 of the CPU they had as 2 cells on 2.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Any

from gyre.sim.bound import lower_bound
from gyre.sim.calibrate import RunRecord, calibrate, run_shape
from gyre.sim.simulator import SimResult, simulate
from gyre.sim.workload import Call, CellModel, Rollout, Trace, tool_factor


@dataclass(frozen=True)
class Costs:
    """What a scheduler's runs say about the machine and the harness, apart from the workload."""

    cell: CellModel  # engine, training, switch and step costs (its capacity is replaced by the target's)
    gap_s: float  # the harness's own seconds between a call and the next, beyond its tool sleeps
    last_s: float  # after the last call and before the first (start-up, the final tool), beyond tool sleeps
    outside_s: float  # a session's seconds outside the harness (sandbox start-up, grading)
    cells_per_cpu: float = 1.0  # the runs' cells over the CPUs they share (at least 1: a CPU each)
    harnesses_per_cpu: float = 1.0  # the same with the controller's harnesses as one more job


def sharing(run: RunRecord) -> tuple[float, float]:
    """How many cells, and cells plus the controller's harnesses, share each of the run's CPUs (at least 1).
    On one machine a cell's engine and trainer, and the harnesses, run at their share of the CPUs they
    share: costs fitted on one layout scale by these to another (gyre.sim.calibrate.workload_facts)."""
    n, cpus = run.shape["n_cells"], run.shape.get("cpus") or math.inf
    return max(1.0, n / cpus), max(1.0, (n + 1) / cpus)


def at_sharing(costs: Costs, run: RunRecord) -> Costs:
    """`costs` moved to the run's layout: CPU work slower (or faster) by the ratio of the CPU shares."""
    cells, harnesses = sharing(run)
    k, h = cells / costs.cells_per_cpu, harnesses / costs.harnesses_per_cpu
    if k == 1.0 and h == 1.0:
        return costs
    c = costs.cell
    cell = replace(c, call_s=c.call_s * k, session_tps=c.session_tps / k, decode_tps=c.decode_tps / k,
                   train_tps=c.train_tps / k, to_train_s=c.to_train_s * k, to_rollout_s=c.to_rollout_s * k,
                   reduce_s=c.reduce_s * k, sync_s=c.sync_s * k, group_write_s=c.group_write_s * h)  # fmt: skip
    return replace(costs, cell=cell, gap_s=costs.gap_s * h, last_s=costs.last_s * h, outside_s=costs.outside_s * h,
                   cells_per_cpu=cells, harnesses_per_cpu=harnesses)  # fmt: skip


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


def fit_costs(runs: list[RunRecord]) -> Costs:
    """The costs of `runs` (any schedulers of one machine and harness): medians over their sessions."""
    if not runs:
        raise ValueError("fitting costs needs at least one run")
    gaps, lasts, outside = [], [], []
    for run in runs:
        for rid, sess in run.sessions.items():
            parts = split_gaps(run, rid, sess)
            gaps += [rest for _, rest in parts[:-1]]
            lasts += [rest for _, rest in parts[-1:]]
            outside.append(max(0.0, sess["seconds"] - sess["harness_s"]))
    med = lambda xs: statistics.median(xs) if xs else 0.0  # noqa: E731
    cells, harnesses = (statistics.median(x) for x in zip(*(sharing(r) for r in runs), strict=True))
    return Costs(calibrate(runs).cell, med(gaps), med(lasts), med(outside), cells, harnesses)


def workload_of(run: RunRecord, costs: Costs) -> Trace:
    """The run's workload (its sessions' tokens and tool sleeps) with the harness's own seconds of `costs`."""
    shape = run_shape(run)
    tokens = statistics.median(run.step_tokens) / (shape.groups_per_step * shape.group_size) if run.step_tokens else 0
    by_step: dict[int, list[Rollout]] = {}
    for rid, sess in sorted(run.sessions.items()):
        parts = split_gaps(run, rid, sess)
        calls = tuple(
            Call(int(p), int(d), slept + (costs.last_s if i == len(parts) - 1 else costs.gap_s))
            for i, ((p, d, *_), (slept, _)) in enumerate(zip(sess["calls"], parts, strict=True))
        )
        step, group = int(rid[1:].split("-")[0]), int(rid.split("-")[1][1:])
        by_step.setdefault(step, []).append(Rollout(rid, group, calls, costs.outside_s, round(tokens)))
    return Trace(by_step)


def predict(costs: Costs, target: RunRecord, scheduler: str | None = None) -> SimResult:
    """`scheduler` (the target's own by default) on the target run's workload and shape, at `costs`."""
    costs = at_sharing(costs, target)
    cell = replace(costs.cell, capacity=target.shape["capacity"])
    return simulate(scheduler or target.scheduler, cell, run_shape(target), workload_of(target, costs))


def run_bound(costs: Costs, run: RunRecord) -> float:
    """The lower bound (gyre.sim.bound) on the run's own workload and shape, at `costs`."""
    costs = at_sharing(costs, run)
    cell = replace(costs.cell, capacity=run.shape["capacity"])
    return lower_bound(cell, run_shape(run), workload_of(run, costs)).seconds
