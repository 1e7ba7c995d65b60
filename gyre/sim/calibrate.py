"""The simulator's parameters, fitted from a cell job's own outputs (metrics.jsonl, calls.jsonl, config.yaml).

From each run directory: every session (its calls' prefill and decode tokens, the gaps between them:
tool time, and the time outside the harness: start-up and grading), every micro-batch (tokens,
seconds), every role switch (latency each way, sessions moved), and every step (gradient reduction,
weight sync, tokens trained). Several runs of one workload (different schedulers, repeats) pool into
one `Calibration`: the cell model from all of them, and for each rollout id the measured rollout
whose harness time is that id's median (the workload is the same for every scheduler: the same
tasks, the same per-rollout tool factor).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gyre.config.schema import Admission
from gyre.sched.launch.affinity import available_cpus, parse_cpu_list
from gyre.sim.workload import Call, CellModel, Rollout, RunShape, Trace


@dataclass
class RunRecord:
    """What one run directory says, reduced to what calibration needs (JSON-ready)."""

    scheduler: str
    wall_s: float
    shape: dict[str, Any]
    sessions: dict[str, dict[str, Any]]  # rollout id -> {seconds, harness_s, calls: [[prefill, decode, dur, gap]],
    #                                      started (runs recorded since it was kept), grade_s (since graded
    #                                      outside its slot)}
    micro_batches: list[tuple[int, float, bool]]  # (tokens, seconds, first on its cell since it began training)
    switches: dict[str, list[float]]  # direction -> latencies
    reduce_s: list[float]
    sync_s: list[float]
    step_tokens: list[float]  # tree tokens trained per step
    calls: list[tuple[float, int, int, float]] = field(default_factory=list)  # (t_start, concurrency, decode, dur)
    group_write_s: list[float] = field(default_factory=list)  # seconds per completed group's shard
    group_write_blocks: bool = True  # the controller's loop wrote them (runs from before the writer thread)
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds by component, as tools/bench_schedulers
    #                                                        measured them (empty: a run it did not measure)

    def to_json(self) -> dict[str, Any]:
        return _rounded(asdict(self))

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RunRecord:
        return cls(**d)


def _rounded(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


def read_run(run_dir: str | Path) -> RunRecord:
    d = Path(run_dir)
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = json.loads((d / "summary.json").read_text())
    calls_by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    all_calls = []
    for line in (d / "calls.jsonl").read_text().splitlines():
        c = json.loads(line)
        calls_by[c["rollout_id"]].append(c)
        all_calls.append((c["t_start"], c["t_end"], c["engine_url"], len(c["output_ids"])))
    sessions = _sessions(rows, calls_by)
    steps = [r for r in rows if r["event"] == "step"]
    switches: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r["event"] == "switch" and not r["initial"]:
            switches[r["direction"]].append(r["latency_s"])
    s, rl, sched = cfg["sched"], cfg["rl"], cfg["harness"]
    shape = {
        "steps": cfg["steps"],
        "groups_per_step": rl["groups_per_step"],
        "group_size": rl["group_size"],
        "n_cells": 1 + len(cfg["cluster"]["satellites"]),
        "staleness": s["staleness"],
        "micro_batch_tokens": cfg["train"]["micro_batch_tokens"],
        "micro_batches_in_flight": s["micro_batches_in_flight"],
        "timeout_s": sched["timeout_s"],
        "async_rollout_cells": s["async_rollout_cells"],
        "capacity": s["capacity_per_cell"],
        "admission": s.get("admission", Admission.fifo),
        **workload_facts(cfg),
    }
    return RunRecord(
        cfg["scheduler"],
        summary["wall_s"],
        shape,
        sessions,
        _micro_batches(rows),
        dict(switches),
        [r["reduce_s"] for r in steps],
        [r["sync_s"] for r in steps],
        [r["tree_tokens"] for r in steps],
        _concurrency(all_calls),
        _group_writes(rows, rl["group_size"]),
        not any("blocked_s" in r for r in rows if r["event"] == "group"),
    )


def _sessions(rows: list[dict[str, Any]], calls_by: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each session row's seconds (harness, grading, start) and its calls as [uncached prompt tokens, output
    tokens, call seconds, harness seconds after it]."""
    sessions = {}
    for r in rows:
        if r["event"] != "session":
            continue
        calls = sorted(calls_by.get(r["rollout_id"], []), key=lambda c: c["t_start"])
        out = []
        for i, c in enumerate(calls):
            gap = calls[i + 1]["t_start"] - c["t_end"] if i + 1 < len(calls) else 0.0
            out.append([c["prompt_tokens"] - c["cached_tokens"], len(c["output_ids"]), c["t_end"] - c["t_start"], gap])
        inside = sum(x[2] + x[3] for x in out)
        if out:  # harness time not between calls (before the first, after the last: its final tool call)
            out[-1][3] += max(0.0, r.get("harness_s", inside) - inside)
        sessions[r["rollout_id"]] = {"seconds": r["seconds"], "harness_s": r.get("harness_s", inside), "calls": out}
        if "grade_s" in r:  # after its harness, outside its slot (runs before sessions were graded outside one: none)
            sessions[r["rollout_id"]]["grade_s"] = r["grade_s"]
        if "started" in r:  # on the controller's timeline: how many sessions shared the machine with this one
            sessions[r["rollout_id"]]["started"] = r["started"]
    return sessions


def workload_facts(cfg: dict[str, Any]) -> dict[str, Any]:
    """What a run's config says about the parts of its sessions no scheduler changes, and the machine: the
    built-in harness's tool sleep (tasks.tool_time_s x the rollout's factor, gyre.harness.builtin) and the
    CPUs the controller's harnesses share with the cells (its CPU set; the machine's when none is given)."""
    sets = cfg["sched"].get("cpu_sets") or []
    cpus = len(parse_cpu_list(sets[0])) if sets else len(available_cpus())
    tasks = cfg.get("tasks", {})
    return {"tool_time_s": tasks.get("tool_time_s", 0.0), "tool_time_sigma": tasks.get("tool_time_sigma", 0.0),
            "cpus": cpus}  # fmt: skip


def _group_writes(rows: list[dict[str, Any]], group_size: int) -> list[float]:
    """How long each completed group's shard took to write and plan: the `group` events (on the writer's
    thread when they carry `blocked_s`, else in the controller's loop), or in a run from before they were
    logged, the time from the session row that completed the group to the controller's next row (an upper
    bound: the loop may have waited for news)."""
    if direct := [r["seconds"] for r in rows if r["event"] == "group"]:
        return direct
    seen: dict[tuple[int, str], int] = defaultdict(int)
    out = []
    for i, r in enumerate(rows[:-1]):
        if r["event"] != "session":
            continue
        key = (r["step"], r["rollout_id"].rsplit("-", 1)[0])
        seen[key] += 1
        if seen[key] == group_size:
            if "t" in r and "t" in rows[i + 1]:
                out.append(max(0.0, rows[i + 1]["t"] - r["t"]))
    return out


def _micro_batches(rows: list[dict[str, Any]]) -> list[tuple[int, float, bool]]:
    out, fresh = [], defaultdict(lambda: True)
    for r in rows:
        if r["event"] == "switch" and r["direction"].endswith("->train"):
            fresh[r["cell"]] = True
        elif r["event"] == "micro_batch":
            out.append((r["tokens"], r["seconds"], fresh[r["cell"]]))
            fresh[r["cell"]] = False
    return out


def _concurrency(calls: list[tuple[float, float, str, int]]) -> list[tuple[float, int, int, float]]:
    """Each call with the number of calls on its engine when it started (itself included)."""
    out = []
    by_engine: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for t0, t1, url, dec in calls:
        by_engine[url].append((t0, t1, dec))
    for items in by_engine.values():
        items.sort()
        for i, (t0, t1, dec) in enumerate(items):
            n = 1 + sum(1 for a, b, _ in items[max(0, i - 64) : i] if b > t0)
            out.append((t0, n, dec, t1 - t0))
    return out


@dataclass
class Calibration:
    cell: CellModel
    shape: RunShape
    rollouts: dict[str, Rollout]  # rollout id -> its representative rollout
    measured: dict[str, list[float]]  # scheduler -> wall seconds of its runs

    def trace(self) -> Trace:
        by_step: dict[int, list[Rollout]] = defaultdict(list)
        for rid, r in sorted(self.rollouts.items()):
            by_step[int(rid[1:].split("-")[0])].append(r)
        return Trace(dict(by_step))

    def to_json(self) -> dict[str, Any]:
        return {
            "cell": asdict(self.cell),
            "shape": asdict(self.shape),
            "rollouts": {k: asdict(v) for k, v in self.rollouts.items()},
            "measured": self.measured,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Calibration:
        rollouts = {
            k: Rollout(
                v["rollout_id"],
                v["group"],
                tuple(_call(c) for c in v["calls"]),
                v["overhead_s"],
                v["train_tokens"],
                v.get("cpu_s", 0.0),
                v.get("end_s", 0.0),
                v.get("end_cpu_s", 0.0),
            )
            for k, v in d["rollouts"].items()
        }
        shape = RunShape(**{**d["shape"], "timeout_s": float(d["shape"]["timeout_s"])})
        return cls(CellModel(**d["cell"]), shape, rollouts, d["measured"])


def _call(c: dict[str, Any] | list[Any]) -> Call:
    return Call(**c) if isinstance(c, dict) else Call(int(c[0]), int(c[1]), float(c[2]))


def calibrate(runs: list[RunRecord]) -> Calibration:
    if not runs:
        raise ValueError("calibration needs at least one run directory")
    shape = run_shape(runs[0])
    capacity = runs[0].shape["capacity"]
    return Calibration(fit_cell(runs, capacity), shape, fit_rollouts(runs, shape), measured_walls(runs))


def run_shape(run: RunRecord) -> RunShape:
    """The run's shape; a run recorded before sched.admission existed admitted its sessions as submitted."""
    known = {f for f in RunShape.__dataclass_fields__}
    return RunShape(**{"admission": Admission.fifo} | {k: v for k, v in run.shape.items() if k in known})


def measured_walls(runs: list[RunRecord]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(list)
    for r in runs:
        out[r.scheduler].append(r.wall_s)
    return dict(out)


def fit_cell(runs: list[RunRecord], capacity: int) -> CellModel:
    # every micro-batch at the mean rate: a cell's first after it began training is slower (warm-up), but
    # giving it its own term moved one run's simulated wall by 25% (a tail rollout missed a step's cut-off)
    tokens = sum(t for r in runs for t, _, _ in r.micro_batches)
    seconds = sum(s for r in runs for _, s, _ in r.micro_batches)
    train_tps = tokens / seconds if seconds else 1e9
    lat = {d: [x for r in runs for x in r.switches.get(d, [])] for d in ("rollout->train", "train->rollout")}
    call_s, per_token, per_token_shared = fit_engine([c for r in runs for c in r.calls])
    return CellModel(
        capacity=capacity,
        decode_tps=1.0 / per_token_shared if per_token_shared > 0 else 1e9,
        session_tps=1.0 / per_token if per_token > 0 else 1e9,
        prefill_tps=1e12,  # prompts are all but fully cached here: prefill is inside call_s
        call_s=call_s,
        train_tps=train_tps,
        micro_batch_s=0.0,
        to_train_s=statistics.median(lat["rollout->train"]) if lat["rollout->train"] else 0.0,
        to_rollout_s=statistics.median(lat["train->rollout"]) if lat["train->rollout"] else 0.0,
        reduce_s=statistics.median(x for r in runs for x in r.reduce_s),
        sync_s=statistics.median(x for r in runs for x in r.sync_s),
        group_write_s=statistics.median(writes) if (writes := [x for r in runs for x in r.group_write_s]) else 0.0,
        group_write_blocks=all(r.group_write_blocks for r in runs),
    )


def fit_engine(calls: list[tuple[float, int, int, float]]) -> tuple[float, float, float]:
    """Least squares of a call's seconds on decode tokens alone and decode tokens x other calls in flight:
    (fixed seconds, seconds per token alone, seconds per token per other call), each at least 0."""
    return fit_engine_rows([(1.0, float(dec), float(n), dur) for _, n, dec, dur in calls])


def fit_engine_rows(rows: list[tuple[float, float, float, float]]) -> tuple[float, float, float]:
    """The same from rows of (slowdown, decode tokens, calls on its engine, seconds): a call's seconds =
    slowdown x (fixed + decode tokens x (per token + per token x other calls)), each coefficient at least 0.

    Least squares weighted by 1 / slowdown, so that the fitted seconds of the rows add up to their measured
    seconds (the fixed term's normal equation is then the sum of the residuals). The slowdowns come from a
    replay (gyre.sim.predict.fit_costs), whose contention at a call is not the one the call met: unweighted,
    the most slowed rows decided the fit and a CPU-bound run's calls came out 30% short in total (elastic on
    training ~ rollouts in bench38: 144-160 s measured, 109-111 s fitted)."""
    import numpy as np

    if len(rows) < 3:
        return 0.0, 0.0, 0.0
    weight = np.array([1.0 / math.sqrt(s) for s, *_ in rows])  # rows scaled by it: squares weighted 1 / slowdown
    x = np.array([[s, s * dec, s * dec * max(0.0, n - 1)] for s, dec, n, _ in rows]) * weight[:, None]
    y = np.array([seconds for *_, seconds in rows]) * weight
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    a, b, c = (max(0.0, float(v)) for v in coef)
    return a, b, c


def fit_rollouts(runs: list[RunRecord], shape: RunShape) -> dict[str, Rollout]:
    """Each rollout id's representative: the measured session whose harness time is the median over the
    runs."""
    by_id: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        for rid, s in r.sessions.items():
            by_id[rid].append(s)
    tokens_per_rollout = statistics.median(t for r in runs for t in r.step_tokens) / (
        shape.groups_per_step * shape.group_size
    )
    out = {}
    for rid, seen in by_id.items():
        seen = sorted(seen, key=lambda s: s["harness_s"])
        rep = seen[len(seen) // 2]
        outside = [s["seconds"] - s["harness_s"] - s.get("grade_s", 0.0) for s in seen]
        overhead = statistics.median(outside)
        end = statistics.median(s.get("grade_s", 0.0) for s in seen)
        calls = tuple(Call(int(p), int(d), max(0.0, gap)) for p, d, _, gap in rep["calls"])
        group = int(rid.split("-")[1][1:])
        out[rid] = Rollout(rid, group, calls, max(0.0, overhead), round(tokens_per_rollout), end_s=end)
    return out


def calibrate_dirs(run_dirs: list[Path]) -> Calibration:
    return calibrate([read_run(d) for d in run_dirs])
