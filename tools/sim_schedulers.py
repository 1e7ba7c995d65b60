"""Elastic vs colocate vs async in the simulator (gyre.sim): validation, the reference system's scale, a map.

    python -m tools.sim_schedulers [--out DIR] [--data same-work|same-work-2|same-work-12|same-work-3|same-work-4|learning]
                                   [--bench DIR [--save-data]] [--workloads W,W] [--quick] [--cross]
                                   [--capacity N,N,...] [--carry] [--free-cpus] [--steps N,N,...]
                                   [--admission] [--fit-from DATA]

1. Validation: every run of the recorded local benchmark (tools/bench_schedulers.py: layouts disjoint2 and
   shared3, tails sigma 0.5 and 1.0, training as costly as rollouts) is simulated from its own calibration
   (its sessions, micro-batches, switches, steps, the controller's shard writes), fitted now from the run's
   records; the medians over repeats beside the measured medians. Six recorded benchmarks (`--data`):
   `same-work` (tools/sim_data/bench30_runs.json.gz, the default: a frozen policy, every run of a workload
   the same sessions), `same-work-2` (bench32_runs.json.gz: the same command again since a session frees its
   slot before it is graded, with each run's CPU seconds by component), `same-work-12` (bench33_runs.json.gz:
   disjoint2's two tails with runs of 12 steps), `same-work-3` (bench37_runs.json.gz: the four workloads again
   since a freed slot goes to the group that looks longest, sched.admission), `same-work-4` (bench38_runs.json.gz:
   the four again since sandboxes start without a fork of the controller) and `learning`
   (bench29_runs.json.gz: the policy learns, each run draws its own work); `--bench DIR` reads a benchmark's
   output directories instead (each directory under DIR that holds run directories is a workload:
   DIR/<layout>/<workload>/<scheduler>-<n>/), `--save-data` stores their records as the `--data` file;
   `--workloads` reads only some of its workloads.
   1b. Cross-prediction (`--cross` prints 1b, 1c and 1e only): costs fitted from one scheduler's runs alone,
   each alone on a CPU (gyre.sim.predict.fit_costs), every run of the other schedulers predicted on its own
   workload (its sessions' tokens and tool sleeps) and CPUs; `--cross --fit-from DATA` fits the costs from another
   recorded benchmark's runs instead and predicts every run of --data's (1b and 1c only). 1c. Held-out workloads: costs from one
   workload's runs of one scheduler, every run of the other workloads and layouts predicted. 1d. Each run's lower bound on its own workload at
   costs shared by every scheduler, and every scheduler simulated on the same work: the speedups the
   policies give on equal work, and the most any scheduler could be faster than each baseline. 1e. Each
   scheduler's costs from its own runs, as measured (on the same work, what its schedule did to the
   machine) and fitted alone on a CPU (what the model of that leaves apart). 1f (`--capacity 4,6,8`
   prints it only): every scheduler on the same work, as 1d, with the session capacity per cell changed for all.
   1g (`--carry` prints it only): every scheduler on the same work, as 1d, with groups carried across step
   boundaries (gyre.sim.what_if.CarryAcrossSteps: a step trains the first groups to complete), not built.
   1h (`--free-cpus` prints it only): every scheduler on the same work, as 1d, on the runs' CPUs and with a CPU
   per job, and elastic's cell-seconds of no work on free CPUs, while sessions queued and while none was admitted.
   1i (`--steps 12,24` prints it only): every scheduler on the same work, as 1h, with each run made longer (each
   step it lacks draws its sessions from the run's own: gyre.sim.predict.longer), where the pipeline's first
   and last steps weigh less than in the benchmark's 6. 1j (`--admission` prints it only): every scheduler on
   the same work, as 1d, under each rule of which queued session takes a freed slot (sched.admission:
   gyre.sched.policy.admission; the recorded runs admitted as submitted, `fifo`).
2. The reference system's scale: the 2.4T setting (4 cells of 48 nodes x 8 GPUs) and the 122B setting
   (24 and 32 nodes), with the throughputs and costs below stated as assumptions, beside the reference
   table; GPU utilisation of each scheduler and the lower bound (gyre.sim.bound).
3. A map: tail heaviness x training/rollout cost x number of cells, heatmaps of elastic's speedup over
   each baseline and its distance from the lower bound.
Writes DIR/results.json and DIR/*.png (default outputs/sim_schedulers).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from gyre.config.schema import CELL_SCHEDULERS as SCHEDULERS
from gyre.config.schema import Admission
from gyre.sched.policy import KEEP_TRAINING
from gyre.sim.bound import alone_seconds, lower_bound
from gyre.sim.calibrate import Calibration, RunRecord, calibrate, read_run
from gyre.sim.predict import Costs, fit_costs, measured_costs, predict, run_bound
from gyre.sim.simulator import SimResult, simulate
from gyre.sim.what_if import predict_carrying
from gyre.sim.workload import CellModel, RunShape, Workload

ROOT = Path(__file__).resolve().parents[1]
# the recorded benchmarks (tools/bench_schedulers.py; docs/benchmarks.md): its default, every scheduler on the
# same work, and with --learn, where each run draws its own
RECORDED = {
    "same-work": ROOT / "tools" / "sim_data" / "bench30_runs.json.gz",
    "learning": ROOT / "tools" / "sim_data" / "bench29_runs.json.gz",
    # the same-work benchmark again since a session frees its slot before it is graded (f825026)
    "same-work-2": ROOT / "tools" / "sim_data" / "bench32_runs.json.gz",
    # disjoint2's two tails again with runs of 12 steps (--steps 12), the code unchanged since same-work-2
    "same-work-12": ROOT / "tools" / "sim_data" / "bench33_runs.json.gz",
    # the four workloads again since a freed slot goes to the group that looks longest (sched.admission)
    "same-work-3": ROOT / "tools" / "sim_data" / "bench37_runs.json.gz",
    # the four workloads again since sandboxes start without a fork of the controller (its CPU 13 -> 9 s a run)
    "same-work-4": ROOT / "tools" / "sim_data" / "bench38_runs.json.gz",
}
RUN_NAME = re.compile(rf"({'|'.join(SCHEDULERS)})-\d+")  # a run directory of tools/bench_schedulers.py
WORKLOADS = {"sigma0.5": "tail sigma 0.5", "sigma1.0": "tail sigma 1.0", "trainheavy": "training ~ rollouts"}
HOUR = 3600.0

# ----- the reference system's scale: assumptions, not measurements -----
# 2.4T MoE: SGLang at 128 concurrent 700K-token sessions a cell: 40 tokens/s for one call alone, 3200 tokens/s
# decode and 2e5 tokens/s prefill a cell; role switch 8.52 s / 3.46 s (the reference's figures); weight sync 60 s.
# Training 3.6e4 tokens/s a cell: chosen so that one cell trains a step (512 x 700K tokens) in ~2.8 h, the
# reference's async time per step (its training side is one cell); not derived from FLOPs
REF_24T = {
    "cell": CellModel(
        capacity=128,
        decode_tps=3200,
        session_tps=40,
        prefill_tps=2e5,
        call_s=0.5,
        train_tps=3.6e4,
        micro_batch_s=2.0,
        to_train_s=8.52,
        to_rollout_s=3.46,
        reduce_s=30,
        sync_s=60,
        kv_migration_s=0.05,
        group_write_s=1.0,
    ),  # fmt: skip
    "shape": RunShape(
        steps=48,
        groups_per_step=32,
        group_size=16,
        n_cells=4,
        staleness=1,
        micro_batch_tokens=2_000_000,
        timeout_s=1.25 * HOUR,
    ),  # fmt: skip
    # ~700K tokens: 140 calls of 4700 new prompt + 300 generated tokens; 6 s of tools after each call, a long tail
    # (lognormal sigma 1.2 per rollout on tool time, 0.5 on the number of calls) against a 1.25 h timeout
    "workload": Workload(
        calls_mean=140,
        prefill_per_call=4700,
        decode_per_call=300,
        tool_s=6.0,
        tail_sigma=1.2,
        overhead_s=120,
        train_tokens_per_rollout=700_000,
        calls_sigma=0.5,
        max_calls_per_segment=10,
    ),  # fmt: skip
    "reference_h": {"elastic": 75.42, "async": 134.55, "colocate_cells": 91.47},
}
# 122B MoE (~10B active) on cells of 8 nodes x 8 GPUs: fwd-bwd ~3.2e5 tokens/s a cell; ~200K-token rollouts
REF_122B_CELL = CellModel(
    capacity=128, decode_tps=5120, session_tps=80, prefill_tps=3e5, call_s=0.3, train_tps=3.2e5, micro_batch_s=1.0,
    to_train_s=4.0, to_rollout_s=2.0, reduce_s=5, sync_s=10, kv_migration_s=0.02, group_write_s=0.5,
)  # fmt: skip
REF_122B_WORKLOAD = Workload(calls_mean=80, prefill_per_call=2300, decode_per_call=200, tool_s=6.0, tail_sigma=1.2,
                             overhead_s=60, train_tokens_per_rollout=200_000, calls_sigma=0.5, max_calls_per_segment=5)  # fmt: skip


def ref_122b(nodes: int) -> dict[str, Any]:
    cells = nodes // 8
    return {
        "cell": REF_122B_CELL,
        "shape": RunShape(
            steps=48,
            groups_per_step=8 * cells,
            group_size=16,
            n_cells=cells,
            staleness=1,
            micro_batch_tokens=1_000_000,
            timeout_s=1 * HOUR,
        ),  # fmt: skip
        "workload": REF_122B_WORKLOAD,
        "reference_h": {},
    }


# ----- 1. validation -----
def load_calibrations(bench: Path | None, data: str = "same-work") -> dict[str, dict[str, Calibration]]:
    """workload -> run name -> the run's own calibration, fitted now from its records (the recorded benchmark
    `data`, or a bench_schedulers output directory laid out as bench/<workload>/<scheduler>-<n>/)."""
    records = load_records(bench, data)
    return {wl: {name: calibrate([rec]) for name, rec in runs.items()} for wl, runs in records.items()}


def load_records(bench: Path | None, data: str = "same-work") -> dict[str, dict[str, RunRecord]]:
    """workload -> run name -> its record: from a bench_schedulers output directory (every directory under
    `bench` that holds run directories, by its path: DIR/<layout>/<workload>/<scheduler>-<n>/), or from the
    recorded benchmark `data` (RECORDED)."""
    if bench is not None:
        out: dict[str, dict[str, RunRecord]] = {}
        runs = sorted(
            Path(d)
            for d, _, files in os.walk(bench, followlinks=True)
            if "summary.json" in files and RUN_NAME.fullmatch(Path(d).name)
        )
        for run in runs:
            out.setdefault(str(run.parent.relative_to(bench)), {})[run.name] = read_run(run)
        for wl, records in out.items():  # the CPU seconds bench_schedulers measured for each run, where it did
            for name, cpu_s in _measured_cpu(bench / wl).items():
                if name in records:
                    records[name].cpu_s = cpu_s
        return out
    stored = json.loads(gzip.decompress(RECORDED[data].read_bytes()))
    return {wl: {name: RunRecord.from_json(r) for name, r in d["runs"].items()} for wl, d in stored.items()}


def _measured_cpu(workload_dir: Path) -> dict[str, dict[str, float]]:
    """run name -> CPU seconds by component, from a bench_schedulers workload directory's results (or its
    progress, for a benchmark stopped early); none for a directory it did not write."""
    for name in ("results.json", "progress.json"):
        path = workload_dir / name
        if path.exists():
            found = json.loads(path.read_text())
            runs = found["runs"] if name == "results.json" else found  # scheduler -> its runs
            return {Path(r["out"]).name: r.get("cpu_s", {}) for rs in runs.values() for r in rs}
    return {}


def label(workload: str) -> str:
    layout, _, name = workload.rpartition("/")
    return f"{layout} {WORKLOADS.get(name, name)}".strip()


def save_records(bench: Path, data: str, records: dict[str, dict[str, RunRecord]]) -> None:
    """Store a benchmark's run records (what calibration reads from each run directory) as RECORDED[data],
    with each workload's bench_schedulers arguments and, where it measured it, the share of rollouts that
    sampled the same tokens in every run (`same_work`)."""
    stored = {}
    for wl, runs in records.items():
        results = bench / wl / "results.json"
        meta = json.loads(results.read_text()) if results.exists() else {}
        stored[wl] = {"bench_args": meta.get("extra", []), "same_work": meta.get("table", {}).get("same_work"),
                      "runs": {name: r.to_json() for name, r in runs.items()}}  # fmt: skip
    path = RECORDED[data]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(json.dumps(stored).encode()))
    print(f"sim_schedulers: {sum(len(d['runs']) for d in stored.values())} run records in {path}")


def validate(cals: dict[str, dict[str, Calibration]]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for wl, runs in cals.items():
        rows = {}
        for sched in SCHEDULERS:
            mine = {n: c for n, c in runs.items() if n.rsplit("-", 1)[0] == sched}
            sims = {n: simulate(sched, c.cell, c.shape, c.trace()) for n, c in mine.items()}
            bounds = [lower_bound(c.cell, c.shape, c.trace()).seconds for c in mine.values()]
            measured = [c.measured[sched][0] for c in mine.values()]
            simulated = [s.wall_s for s in sims.values()]
            # the model without the controller's shard writes (what the simulator assumed before they were fitted)
            unwritten = [
                simulate(sched, replace(c.cell, group_write_s=0.0), c.shape, c.trace()).wall_s for c in mine.values()
            ]
            rows[sched] = {
                "measured_s": round(statistics.median(measured), 2),
                "simulated_s": round(statistics.median(simulated), 2),
                "error": round(statistics.median(simulated) / statistics.median(measured) - 1, 4),
                "bound_s": round(statistics.median(bounds), 2),
                "no_shard_writes_s": round(statistics.median(unwritten), 2),
                "group_write_s": round(statistics.median(c.cell.group_write_s for c in mine.values()), 3),
                "measured_runs": measured,
                "simulated_runs": [round(x, 2) for x in simulated],
            }
        order = {k: sorted(SCHEDULERS, key=lambda s: rows[s][k]) for k in ("measured_s", "simulated_s")}
        table[wl] = {**rows, "same_order": order["measured_s"] == order["simulated_s"], "order": order}
    return table


def print_validation(table: dict[str, Any]) -> None:
    print("\n1. Validation: the local benchmark, each run simulated from its own calibration")
    print(f"{'workload':30s} {'scheduler':15s} {'measured s':>10s} {'simulated s':>11s} {'error':>7s} {'bound s':>8s} "
          f"{'no shard writes':>15s} {'shard write':>11s}")  # fmt: skip
    for wl, rows in table.items():
        for sched in SCHEDULERS:
            r = rows[sched]
            off = r["no_shard_writes_s"] / r["measured_s"] - 1
            print(f"{label(wl):30s} {sched:15s} {r['measured_s']:10.1f} {r['simulated_s']:11.1f} "
                  f"{r['error']:+7.1%} {r['bound_s']:8.1f} {r['no_shard_writes_s']:7.1f} ({off:+5.1%}) "
                  f"{r['group_write_s']:9.2f} s")  # fmt: skip
        runs = "; ".join(f"{s} {rows[s]['measured_runs']}" for s in SCHEDULERS)
        print(f"{'':30s} same order: {rows['same_order']} (measured {' < '.join(rows['order']['measured_s'])}); "
              f"measured runs: {runs}")  # fmt: skip


Fitted = dict[str, dict[str, Costs]]  # workload -> scheduler -> the costs of its runs there, alone on a CPU


def scheduler_costs(records: dict[str, dict[str, RunRecord]]) -> Fitted:
    """Each scheduler's costs fitted from its own runs of each workload (gyre.sim.predict.fit_costs), once for
    1b, 1c and 1e."""
    return {wl: {s: fit_costs([r for r in runs.values() if r.scheduler == s]) for s in SCHEDULERS}
            for wl, runs in records.items()}  # fmt: skip


def cross_predict(
    records: dict[str, dict[str, RunRecord]], fitted: Fitted | None = None, elsewhere: str | None = None
) -> dict[str, Any]:
    """Costs fitted from one scheduler's runs of a workload alone (gyre.sim.predict.fit_costs), every other
    run of the workload predicted on its own workload (its sessions' tokens and tool sleeps; nothing its
    scheduler did) and shape. Returns workload -> calibrated-on -> predicted scheduler -> {measured_s: the
    median wall, simulated_s: the median prediction, error: the median of the runs' errors, worst: the
    largest}; the diagonal (a scheduler's own runs, fitted) in the table but not in the summary; plus the
    median and worst error over every run predicted off the diagonal, one error a run and calibration. With
    `elsewhere` (the recorded benchmark `fitted` came from), no run was fitted: the diagonal counts too."""
    fitted = fitted or scheduler_costs(records)
    table: dict[str, Any] = {}
    off: list[float] = []
    for wl, runs in records.items():
        rows: dict[str, Any] = {}
        for src in SCHEDULERS:
            costs = fitted[wl][src]
            rows[src] = {}
            for tgt in SCHEDULERS:
                mine = [r for r in runs.values() if r.scheduler == tgt]
                rows[src][tgt] = predicted(costs, mine)
                if tgt != src or elsewhere:
                    off += [abs(e) for e in rows[src][tgt]["errors"]]
        table[wl] = rows
    return {"table": table, **summary(off), "repeat_noise": repeat_noise(records), "fitted_from": elsewhere}


def held_out(
    records: dict[str, dict[str, RunRecord]], fitted: Fitted | None = None, elsewhere: str | None = None
) -> dict[str, Any]:
    """Costs fitted from one workload's runs of one scheduler, every run of the other workloads (another
    tail, training as costly as rollouts, another layout: 3 cells sharing the CPUs) predicted. Returns
    calibrated-on workload -> scheduler -> predicted workload -> as `cross_predict`, and the summary; with
    `elsewhere`, `fitted` came from that recorded benchmark."""
    fitted = fitted or scheduler_costs(records)
    table: dict[str, Any] = {}
    off: list[float] = []
    for src_wl in records:
        table[src_wl] = {}
        for src in SCHEDULERS:
            costs = fitted[src_wl][src]
            row = {wl: predicted(costs, list(runs.values())) for wl, runs in records.items() if wl != src_wl}
            off += [abs(e) for r in row.values() for e in r["errors"]]
            table[src_wl][src] = row
    return {"table": table, **summary(off), "fitted_from": elsewhere}


def predicted(costs: Costs, runs: list[RunRecord]) -> dict[str, Any]:
    walls = [predict(costs, r).wall_s for r in runs]
    errors = [w / r.wall_s - 1 for w, r in zip(walls, runs, strict=True)]
    return {"measured_s": round(statistics.median(r.wall_s for r in runs), 2),
            "simulated_s": round(statistics.median(walls), 2), "error": round(statistics.median(errors), 4),
            "worst": round(max(errors, key=abs), 4), "errors": [round(e, 4) for e in errors]}  # fmt: skip


def summary(errors: list[float]) -> dict[str, Any]:
    if not errors:
        return {"median_error": None, "worst_error": None, "predictions": 0}
    return {"median_error": round(statistics.median(errors), 4), "worst_error": round(max(errors), 4),
            "predictions": len(errors)}  # fmt: skip


def repeat_noise(records: dict[str, dict[str, RunRecord]]) -> dict[str, float] | None:
    """How far a run's wall is from each other repeat of its scheduler on its workload (median and worst
    relative difference): what a prediction from the scheduler's measured walls alone would err by."""
    errors = []
    for runs in records.values():
        for name, run in runs.items():
            errors += [
                abs(run.wall_s / r.wall_s - 1) for n, r in runs.items() if n != name and r.scheduler == run.scheduler
            ]
    if not errors:
        return None
    return {"median_error": round(statistics.median(errors), 4), "worst_error": round(max(errors), 4), "n": len(errors)}


def print_cross(cross: dict[str, Any]) -> None:
    if elsewhere := cross.get("fitted_from"):
        print(f"\n1b. Cross-prediction from another recording: costs from one scheduler's runs alone in `{elsewhere}`, "
              "every run of each scheduler here predicted on its own workload (median error of its runs)")  # fmt: skip
    else:
        print("\n1b. Cross-prediction: costs from one scheduler's runs alone, every run of each scheduler predicted on "
              "its own workload (median error of its runs; the diagonal, in brackets, was fitted)")  # fmt: skip
    print(f"{'workload':30s} {'calibrated on':15s} " + " ".join(f"{s:>15s}" for s in SCHEDULERS))
    for wl, rows in cross["table"].items():
        for src in SCHEDULERS:
            cells = [
                f"({e:+.1%})" if t == src and not elsewhere else f"{e:+.1%}"
                for t in SCHEDULERS
                for e in [rows[src][t]["error"]]
            ]
            print(f"{label(wl):30s} {src:15s} " + " ".join(f"{c:>15s}" for c in cells))
    print(f"{'all' if elsewhere else 'off the diagonal'} ({cross['predictions']} runs predicted): median error "
          f"{cross['median_error']:.1%}, worst {cross['worst_error']:.1%}")  # fmt: skip
    if noise := cross["repeat_noise"]:
        print(f"the measured walls' own spread (a run against each other repeat of its scheduler): median "
              f"{noise['median_error']:.1%}, worst {noise['worst_error']:.1%} ({noise['n']} pairs)")  # fmt: skip


def print_held_out(held: dict[str, Any]) -> None:
    if not held["predictions"]:
        return
    where = f" in `{held['fitted_from']}`" if held.get("fitted_from") else ""
    print(f"\n1c. Held-out workloads: costs from one workload's runs of one scheduler{where}, every run of the other "
          "workloads and layouts predicted (median error; worst in brackets)")  # fmt: skip
    for src_wl, rows in held["table"].items():
        for src, row in rows.items():
            parts = [f"{label(wl)} {r['error']:+.1%} ({r['worst']:+.1%})" for wl, r in row.items()]
            print(f"{label(src_wl) + ' ' + src:45s} " + "; ".join(parts))
    print(f"all ({held['predictions']} runs predicted): median error {held['median_error']:.1%}, worst "
          f"{held['worst_error']:.1%}")  # fmt: skip


def workload_bounds(records: dict[str, dict[str, RunRecord]]) -> dict[str, Any]:
    """Each run's bound on its own workload at costs fitted from all runs of the benchmark (every scheduler's):
    the same costs for every scheduler, so a scheduler that slows its engines or harnesses does not raise its
    bound; and every scheduler simulated on every run's workload at those costs: the walls each would take
    on the same work (a run's policy decides how many tool calls its sessions make: its workload is its own)."""
    out: dict[str, Any] = {}
    for wl, runs in records.items():
        costs = fit_costs(list(runs.values()))
        bounds = {n: run_bound(costs, r) for n, r in runs.items()}
        same_work = {s: [predict(costs, r, s).wall_s for r in runs.values()] for s in SCHEDULERS}
        rows: dict[str, Any] = {}
        for sched in SCHEDULERS:
            mine = {n: r for n, r in runs.items() if r.scheduler == sched}
            rows[sched] = {
                "measured_s": round(statistics.median(r.wall_s for r in mine.values()), 2),
                "bound_s": round(statistics.median(bounds[n] for n in mine), 2),
                "over_bound": round(statistics.median(r.wall_s / bounds[n] for n, r in mine.items()), 3),
                "same_work_s": round(statistics.median(same_work[sched]), 2),
            }
        e, b = same_work["elastic"], list(bounds.values())
        rows["same_work_speedup"] = {s: paired(same_work[s], e) for s in SCHEDULERS if s != "elastic"}
        rows["same_work_over_bound"] = paired(e, b)
        # what no scheduler can beat a baseline by on this work: the baseline's wall over the bound
        rows["ceiling"] = {s: paired(same_work[s], b) for s in SCHEDULERS if s != "elastic"}
        out[wl] = rows
    return out


BASELINES = [s for s in SCHEDULERS if s != "elastic"]


def compared(walls: dict[str, list[float]], bounds: list[float]) -> dict[str, Any]:
    """Every scheduler's walls on the same runs' work: their medians, elastic's paired speedup over each
    baseline and its wall over the bound (paired by run)."""
    e = walls["elastic"]
    return {"same_work_s": {s: round(statistics.median(w), 1) for s, w in walls.items()},
            "speedup": {s: paired(walls[s], e) for s in BASELINES}, "over_bound": paired(e, bounds)}  # fmt: skip


def shape_sweep(records: dict[str, dict[str, RunRecord]], key: str, values: list[Any]) -> dict[str, Any]:
    """Every scheduler on every run's workload (as 1d) with the runs' shape `key` set to each of `values`, the
    same for every scheduler: median walls, elastic's paired speedups and its wall over the bound at each."""
    out: dict[str, Any] = {}
    for wl, runs in records.items():
        costs = fit_costs(list(runs.values()))
        out[wl] = {}
        for value in values:
            at = [replace(r, shape={**r.shape, key: value}) for r in runs.values()]
            walls = {s: [predict(costs, r, s).wall_s for r in at] for s in SCHEDULERS}
            out[wl][value] = compared(walls, [run_bound(costs, r) for r in at])
    return out


def capacity_sweep(records: dict[str, dict[str, RunRecord]], capacities: list[int]) -> dict[str, Any]:
    """1f: each of `capacities` as every scheduler's session capacity per cell (`sched.capacity_per_cell`)."""
    return shape_sweep(records, "capacity", capacities)


def admission_rules(records: dict[str, dict[str, RunRecord]]) -> dict[str, Any]:
    """1j: each admission rule (`sched.admission`) for every scheduler."""
    return shape_sweep(records, "admission", [str(rule) for rule in Admission])


def print_sweep(table: dict[str, Any], row_label: Any, digits: int) -> None:
    """A shape_sweep table, a line for each workload and value (`row_label(value)` names it)."""
    for wl, rows in table.items():
        for value, row in rows.items():
            walls = ", ".join(f"{s} {v:.{digits}f} s" for s, v in row["same_work_s"].items())
            speed = ", ".join(f"{v:.2f}x {s}" for s, v in row["speedup"].items())
            print(f"{label(wl):30s} {row_label(value)}: {walls}; elastic {speed}, {row['over_bound']:.2f}x the bound")


def print_admission_rules(table: dict[str, Any]) -> None:
    print("\n1j. Which queued session takes a freed slot (sched.admission), the same rule for every scheduler "
          "(simulated on every run's workload at costs from all runs): median walls, elastic's paired speedups, "
          "elastic over the bound")  # fmt: skip
    print_sweep(table, lambda rule: f"{rule:12s}", 1)


def carry_what_if(records: dict[str, dict[str, RunRecord]]) -> dict[str, Any]:
    """Every scheduler on every run's workload (as 1d), as built and with groups carried across step
    boundaries: median walls, and elastic carrying over each baseline as built and carrying."""
    out: dict[str, Any] = {}
    for wl, runs in records.items():
        costs = fit_costs(list(runs.values()))
        built = {s: [predict(costs, r, s).wall_s for r in runs.values()] for s in SCHEDULERS}
        carrying = {s: [predict_carrying(costs, r, s).wall_s for r in runs.values()] for s in SCHEDULERS}
        e = carrying["elastic"]
        out[wl] = {
            "same_work_s": {s: round(statistics.median(w), 1) for s, w in built.items()},
            "carrying_s": {s: round(statistics.median(w), 1) for s, w in carrying.items()},
            "speedup": {s: paired(built[s], e) for s in SCHEDULERS if s != "elastic"},
            "speedup_both_carrying": {s: paired(carrying[s], e) for s in SCHEDULERS if s != "elastic"},
        }
    return out


def free_cpus(records: dict[str, dict[str, RunRecord]]) -> dict[str, Any]:
    """Every scheduler on every run's workload (as 1d), on the run's CPUs and with each engine, trainer and
    harness on a CPU of its own (the contention taken away, every cost as fitted alone): median walls,
    elastic's paired speedups and its wall over the bound, and elastic's cell-seconds of no work on free CPUs
    (training cells without a micro-batch, serving cells' empty slots) while sessions queued for a slot and
    while none did, and its cell-seconds switching (medians over the runs)."""
    out: dict[str, Any] = {}
    for wl, runs in records.items():
        costs = fit_costs(list(runs.values()))
        row: dict[str, Any] = {}
        for name, at in (("shared", list(runs.values())), ("free", [_free(r) for r in runs.values()])):
            results = {s: [predict(costs, r, s) for r in at] for s in SCHEDULERS}
            walls = {s: [x.wall_s for x in rs] for s, rs in results.items()}
            row[name] = compared(walls, [run_bound(costs, r) for r in at])
        idle = [{**x.idle_s, "switching": x.role_seconds.get("switching", 0.0)} for x in results["elastic"]]
        row["elastic_idle_cell_s"] = {k: round(statistics.median(i[k] for i in idle), 1) for k in idle[0]}
        out[wl] = row
    return out


def longer_runs(records: dict[str, dict[str, RunRecord]], steps: list[int]) -> dict[str, Any]:
    """Every scheduler on every run's workload (as 1d) made `steps` long (gyre.sim.predict.longer: each step
    the run lacks draws its sessions from the run's own), on the run's CPUs and with a CPU per job: median
    walls, elastic's paired speedups and its wall over the bound, and each baseline's wall over the bound (the
    most any scheduler could be faster than it); the run as recorded first."""
    out: dict[str, Any] = {}
    for wl, runs in records.items():
        costs = fit_costs(list(runs.values()))
        recorded = statistics.median(r.shape["steps"] for r in runs.values())
        out[wl] = {}
        for n in [None, *steps]:
            row: dict[str, Any] = {}
            for name, at in (("shared", list(runs.values())), ("free", [_free(r) for r in runs.values()])):
                walls = {s: [predict(costs, r, s, n).wall_s for r in at] for s in SCHEDULERS}
                bounds = [run_bound(costs, r, n) for r in at]
                row[name] = {**compared(walls, bounds), "ceiling": {s: paired(walls[s], bounds) for s in BASELINES}}
            out[wl][int(n or recorded)] = row
    return out


def print_longer_runs(table: dict[str, Any]) -> None:
    print("\n1i. Every scheduler on the same work made longer (each step a run lacks draws its sessions from the "
          "run's own; the recorded length first), on the runs' CPUs [with a CPU per job]: median walls, elastic's "
          "paired speedups and wall over the bound")  # fmt: skip
    for wl, rows in table.items():
        for n, row in rows.items():
            shared, free = row["shared"], row["free"]
            walls = ", ".join(
                f"{s} {shared['same_work_s'][s]:.0f} [{free['same_work_s'][s]:.0f}] s" for s in SCHEDULERS
            )
            speed = ", ".join(f"{v:.2f}x [{free['speedup'][s]:.2f}x] {s}" for s, v in shared["speedup"].items())
            most = ", ".join(f"{v:.2f}x [{free['ceiling'][s]:.2f}x] {s}" for s, v in shared["ceiling"].items())
            print(f"{label(wl):30s} {n:3d} steps: {walls}; elastic {speed}; {shared['over_bound']:.2f}x "
                  f"[{free['over_bound']:.2f}x] the bound; the most any scheduler beats each baseline by: {most}")  # fmt: skip


def _free(run: RunRecord) -> RunRecord:
    return replace(run, shape={**run.shape, "cpus": None})


def print_free_cpus(table: dict[str, Any]) -> None:
    print("\n1h. Every scheduler on the same work, on the runs' CPUs -> each job on a CPU of its own (costs from all "
          "runs): median walls; elastic's paired speedups and wall over the bound; on free CPUs, elastic's cell-seconds "
          "of no work (idle trainers, empty slots) while sessions queued and while none was admitted, and switching")  # fmt: skip
    for wl, row in table.items():
        shared, free = row["shared"], row["free"]
        walls = ", ".join(f"{s} {shared['same_work_s'][s]:.0f} -> {free['same_work_s'][s]:.0f} s" for s in SCHEDULERS)
        speed = ", ".join(f"{v:.2f}x -> {free['speedup'][s]:.2f}x {s}" for s, v in shared["speedup"].items())
        idle = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in row["elastic_idle_cell_s"].items())
        print(f"{label(wl):30s} {walls}; elastic {speed}; {shared['over_bound']:.2f}x -> {free['over_bound']:.2f}x "
              f"the bound; cell-s: {idle}")  # fmt: skip


def print_carry_what_if(table: dict[str, Any]) -> None:
    print("\n1g. Groups carried across step boundaries (not built), every scheduler on the same work at costs from "
          "all runs: median walls as built -> carrying; elastic carrying over each baseline as built (carrying)")  # fmt: skip
    for wl, row in table.items():
        walls = ", ".join(
            f"{s} {row['same_work_s'][s]:.0f} -> {row['carrying_s'][s]:.0f} s" for s in row["same_work_s"]
        )
        speed = ", ".join(f"{v:.2f}x ({row['speedup_both_carrying'][s]:.2f}x) {s}" for s, v in row["speedup"].items())
        print(f"{label(wl):30s} {walls}; elastic {speed}")


def print_capacity_sweep(sweep: dict[str, Any]) -> None:
    print("\n1f. Session capacity per cell, the same for every scheduler (simulated on every run's workload at costs "
          "from all runs): median walls, elastic's paired speedups, elastic over the bound")  # fmt: skip
    print_sweep(sweep, lambda cap: f"capacity {cap:2d}", 0)


def paired(walls: list[float], others: list[float]) -> float:
    """The median ratio of two lists of walls on the same runs' workloads."""
    return round(statistics.median(w / o for w, o in zip(walls, others, strict=True)), 3)


def costs_by_scheduler(records: dict[str, dict[str, RunRecord]], fitted: Fitted) -> dict[str, Any]:
    """Each scheduler's costs from its own runs of a workload, as they met them (`measured`) and alone on a CPU
    (`fitted`, gyre.sim.predict.fit_costs): on the same work (the same-work benchmark) what differs between
    the measured ones is what the schedule did to the machine (CPU contention between engines, trainers and
    the harnesses); what differs between the fitted ones, what the model of it leaves out."""
    out: dict[str, Any] = {}
    for wl, runs in records.items():
        out[wl] = {}
        for sched in SCHEDULERS:
            mine = [r for r in runs.values() if r.scheduler == sched]
            out[wl][sched] = {"measured": cost_row(measured_costs(mine)), "fitted": cost_row(fitted[wl][sched])}
    return out


def cost_row(c: Costs) -> dict[str, float]:
    return {"session_tps": round(c.cell.session_tps, 1), "call_s": round(c.cell.call_s, 4),
            "train_tps": round(c.cell.train_tps, 1), "own_s": round(c.own_s, 3)}  # fmt: skip


def print_costs(costs: dict[str, Any]) -> None:
    print("\n1e. Each scheduler's costs from its own runs, as measured and alone on a CPU (fitted): engine decode "
          "tokens/s of a call alone, seconds per call, training tokens/s, a session's own seconds outside calls "
          "and tool sleeps")  # fmt: skip
    for wl, rows in costs.items():
        for sched, kinds in rows.items():
            parts = [f"{k} {kinds['measured'][k]:g} -> {kinds['fitted'][k]:g}" for k in kinds["measured"]]
            print(f"{label(wl):30s} {sched:15s} " + "  ".join(parts))


def print_workload_bounds(bounds: dict[str, Any]) -> None:
    print("\n1d. Each run's lower bound on its own workload (costs from all runs of its benchmark): each scheduler's "
          "median wall over it; and every scheduler simulated on every run's workload (the same work)")  # fmt: skip
    for wl, rows in bounds.items():
        parts = [f"{s} {rows[s]['measured_s']:.0f} s, {rows[s]['over_bound']:.2f}x its bound" for s in SCHEDULERS]
        print(f"{label(wl):30s} measured: " + "; ".join(parts))
        same = "; ".join(f"{s} {rows[s]['same_work_s']:.0f} s" for s in SCHEDULERS)
        speed = ", ".join(f"{v:.2f}x {s}" for s, v in rows["same_work_speedup"].items())
        print(f"{'':30s} same work: {same}; elastic {speed}, {rows['same_work_over_bound']:.2f}x the bound")
        ceiling = ", ".join(f"{v:.2f}x {s}" for s, v in rows["ceiling"].items())
        print(f"{'':30s} the most any scheduler can be faster than each baseline on this work: {ceiling}")


# ----- 2. the reference scale -----
def reference(setting: dict[str, Any]) -> dict[str, Any]:
    cell, shape, wl = setting["cell"], setting["shape"], setting["workload"]
    results: dict[str, SimResult] = {s: simulate(s, cell, shape, wl) for s in SCHEDULERS}
    bound = lower_bound(cell, shape, wl)
    durations = [alone_seconds(r, cell, shape.timeout_s) for r in wl.sample(0, shape)]
    out: dict[str, Any] = {
        s: {"hours": round(r.wall_s / HOUR, 2), "utilisation": round(r.utilisation, 3), "timeouts": r.timeouts,
            "switches": r.switches, "reference_h": setting["reference_h"].get(s)}
        for s, r in results.items()
    }  # fmt: skip
    e = results["elastic"].wall_s
    out["bound_h"] = {"chain": round(bound.chain_s / HOUR, 2), "work": round(bound.work_s / HOUR, 2)}
    out["elastic_over_bound"] = round(e / bound.seconds, 3)
    out["elastic_speedup"] = {s: round(results[s].wall_s / e, 3) for s in ("colocate_cells", "async")}
    before = simulate("elastic", cell, replace(shape, keep_training=shape.n_cells), wl)  # the rule before
    out["elastic_before"] = {"hours": round(before.wall_s / HOUR, 2), "utilisation": round(before.utilisation, 3)}
    out["rollout_h"] = {
        "median": round(statistics.median(durations) / HOUR, 2),
        "max": round(max(durations) / HOUR, 2),
        "at_timeout": sum(1 for d in durations if d >= shape.timeout_s) / len(durations),
    }
    out["assumptions"] = {"cell": asdict(cell), "shape": asdict(shape), "workload": asdict(wl)}
    return out


def print_reference(name: str, r: dict[str, Any]) -> None:
    print(f"\n2. {name}: rollouts median {r['rollout_h']['median']} h, slowest {r['rollout_h']['max']} h, "
          f"{r['rollout_h']['at_timeout']:.0%} at the timeout")  # fmt: skip
    print(f"{'scheduler':15s} {'sim hours':>9s} {'reference h':>11s} {'GPU util':>8s} {'timeouts':>8s}")
    for s in SCHEDULERS:
        x = r[s]
        ref = f"{x['reference_h']:.2f}" if x["reference_h"] else "-"
        print(f"{s:15s} {x['hours']:9.2f} {ref:>11s} {x['utilisation']:8.1%} {x['timeouts']:8d}")
    x = r["elastic_before"]
    print(f"{'(elastic before':15s} {x['hours']:9.2f} {'-':>11s} {x['utilisation']:8.1%}  keep_training = every cell)")
    b = r["bound_h"]
    print(f"{'lower bound':15s} {max(b.values()):9.2f}  (chain {b['chain']} h, work {b['work']} h); elastic is "
          f"{r['elastic_over_bound']:.2f}x the bound; speedup {r['elastic_speedup']}")  # fmt: skip


# ----- 3. the map -----
GRID_TAILS = (0.25, 0.5, 1.0, 1.5)
GRID_RATIOS = (0.1, 0.3, 1.0, 3.0)
GRID_CELLS = (2, 4, 8)


def grid_point(tail: float, ratio: float, cells: int, steps: int) -> dict[str, float]:
    """One workload of the map: one wave of sessions a step (16 per cell), training `ratio` times the
    rollouts' cell-seconds."""
    base = RunShape(steps=steps, groups_per_step=cells, group_size=16, n_cells=cells, staleness=1,
                    micro_batch_tokens=50_000, timeout_s=4 * 600.0)  # fmt: skip
    wl = Workload(calls_mean=20, prefill_per_call=2000, decode_per_call=200, tool_s=20.0, tail_sigma=tail,
                  overhead_s=10, train_tokens_per_rollout=44_000, calls_sigma=0.3)  # fmt: skip
    cell = replace(REF_122B_CELL, capacity=16, to_train_s=4.0, to_rollout_s=2.0, reduce_s=5, sync_s=10)
    rollouts = wl.sample(0, base)
    rollout_cell_s = sum(alone_seconds(r, cell, base.timeout_s) for r in rollouts) / cell.capacity
    tokens = sum(r.train_tokens for r in rollouts)
    cell = replace(cell, micro_batch_s=0.0, train_tps=tokens / (ratio * rollout_cell_s))
    walls = {s: simulate(s, cell, base, wl).wall_s for s in SCHEDULERS}
    # elastic under the rule before KEEP_TRAINING: no training cell serves queued sessions while training waits
    before = simulate("elastic", cell, replace(base, keep_training=cells), wl).wall_s
    bound = lower_bound(cell, base, wl).seconds
    return {
        "vs_colocate": walls["colocate_cells"] / walls["elastic"],
        "vs_async": walls["async"] / walls["elastic"],
        "over_bound": walls["elastic"] / bound,
        "over_bound_before": before / bound,
        **{f"{s}_s": w for s, w in walls.items()},
        "elastic_before_s": before,
        "bound_s": bound,
    }


def print_policy_change(points: list[dict[str, float]]) -> None:
    """Elastic on the map under the rule before (keep_training = every cell) and now (KEEP_TRAINING)."""
    print(f"\n   elastic's policy before/after (sessions that queue while training waits get all but "
          f"{KEEP_TRAINING} trainers):")  # fmt: skip
    print(f"   {'cells':>5s} {'wall/bound before':>17s} {'after':>12s} {'worst before':>12s} {'after':>6s} "
          f"{'points faster':>13s} {'slower':>6s}")  # fmt: skip
    for c in GRID_CELLS:
        pts = [p for p in points if p["cells"] == c]
        b, a = [p["over_bound_before"] for p in pts], [p["over_bound"] for p in pts]
        faster = sum(1 for p in pts if p["elastic_s"] < 0.99 * p["elastic_before_s"])
        slower = sum(1 for p in pts if p["elastic_s"] > 1.01 * p["elastic_before_s"])
        print(f"   {c:5d} {statistics.fmean(b):17.3f} {statistics.fmean(a):12.3f} {max(b):12.3f} {max(a):6.3f} "
              f"{faster:13d} {slower:6d}")  # fmt: skip


def grid(steps: int) -> list[dict[str, float]]:
    return [
        {"tail": t, "ratio": r, "cells": c, **grid_point(t, r, c, steps)}
        for c in GRID_CELLS
        for t in GRID_TAILS
        for r in GRID_RATIOS
    ]


def heatmaps(points: list[dict[str, float]], out: Path) -> list[Path]:
    from matplotlib.figure import Figure

    pngs = []
    titles = {
        "vs_colocate": "elastic speedup over colocate",
        "vs_async": "elastic speedup over async",
        "over_bound": "elastic wall / lower bound",
        "over_bound_before": f"elastic wall / lower bound, before keep_training={KEEP_TRAINING}",
    }
    for key, title in titles.items():
        fig = Figure(figsize=(4.2 * len(GRID_CELLS), 3.8), dpi=110, layout="constrained")
        axes = fig.subplots(1, len(GRID_CELLS))
        vals = [
            p[k] for p in points for k in ((key,) if key.startswith("vs_") else ("over_bound", "over_bound_before"))
        ]
        lo, hi = min(vals), max(vals)
        for ax, c in zip(axes, GRID_CELLS, strict=True):
            m = [[next(p[key] for p in points if p["cells"] == c and p["tail"] == t and p["ratio"] == r)
                  for t in GRID_TAILS] for r in GRID_RATIOS]  # fmt: skip
            im = ax.imshow(m, origin="lower", cmap="viridis", vmin=lo, vmax=hi, aspect="auto")
            for i, row in enumerate(m):
                for j, v in enumerate(row):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w", fontsize=8)
            ax.set_xticks(range(len(GRID_TAILS)), [str(t) for t in GRID_TAILS])
            ax.set_yticks(range(len(GRID_RATIOS)), [str(r) for r in GRID_RATIOS])
            ax.set_xlabel("tail sigma (tool time, lognormal)")
            if c == GRID_CELLS[0]:
                ax.set_ylabel("training / rollout cell-seconds")
            ax.set_title(f"{c} cells")
        fig.colorbar(im, ax=list(axes), shrink=0.8)
        fig.suptitle(title)
        png = out / f"heatmap_{key}.png"
        fig.savefig(png)
        pngs.append(png)
    return pngs


def counts(p: argparse.ArgumentParser, option: str, text: str) -> list[int]:
    """`option`'s whole numbers, at least 1 each, separated by commas; refused (exit 2) otherwise."""
    try:
        numbers = [int(n) for n in text.split(",")]
    except ValueError:
        p.error(f"{option} takes whole numbers separated by commas, not {text!r}")
    if min(numbers) < 1:
        p.error(f"{option}: each number must be at least 1")
    return numbers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "outputs" / "sim_schedulers"))
    p.add_argument("--bench", default=None, help="refit the validation from a bench_schedulers output directory")
    p.add_argument("--data", choices=sorted(RECORDED), default="same-work", help="the recorded benchmark to read")
    p.add_argument("--save-data", action="store_true", help="store the run records of --bench as --data's file")
    p.add_argument("--quick", action="store_true", help="a smaller map (6 steps) and the reference at 12 steps")
    only = p.add_mutually_exclusive_group()  # each prints one part of the output and stops
    only.add_argument(
        "--cross", action="store_true", help="print only the cross-prediction tables (1b, 1c, 1e) and stop"
    )
    only.add_argument("--capacity", default=None, metavar="N,N,...",
                      help="print only 1f, every scheduler simulated at each session capacity per cell, and stop")  # fmt: skip
    only.add_argument("--carry", action="store_true", help="print only 1g, groups carried across steps (not built)")
    only.add_argument("--free-cpus", action="store_true", help="print only 1h, every scheduler with a CPU per job")
    only.add_argument(
        "--admission", action="store_true", help="print only 1j, every scheduler under each admission rule"
    )
    only.add_argument("--steps", default=None, metavar="N,N,...",
                      help="print only 1i, every scheduler on each run's work made N steps long, and stop")  # fmt: skip
    p.add_argument("--fit-from", choices=sorted(RECORDED), default=None,
                   help="with --cross: fit the costs from this recorded benchmark's runs, predict every run of --data's")  # fmt: skip
    p.add_argument("--workloads", default=None, metavar="W,W,...",
                   help="read only these workloads of the benchmark (as layout/workload: disjoint2/sigma0.5)")  # fmt: skip
    args = p.parse_args()
    if args.quick and (args.cross or args.capacity or args.carry or args.free_cpus or args.steps or args.admission):
        p.error("--quick shortens the reference scale and the map (2 and 3), which --cross, --capacity, --carry, "
                "--free-cpus, --steps and --admission do not print")  # fmt: skip
    if args.fit_from and not args.cross:
        p.error("--fit-from takes the cross-prediction's costs (--cross) from another recorded benchmark")
    if args.fit_from and (args.bench or args.fit_from == args.data):
        p.error("--fit-from names a recorded benchmark other than the one predicted (--data, not --bench)")
    if args.save_data:
        if not args.bench:
            p.error("--save-data stores the runs of --bench DIR")
        if args.workloads:
            p.error("--save-data stores every workload of --bench DIR; --workloads reads only some, so not with it")
    # refused before any record is read
    capacities = counts(p, "--capacity", args.capacity) if args.capacity else None
    lengths = counts(p, "--steps", args.steps) if args.steps else None
    bench = Path(args.bench) if args.bench else None
    records = load_records(bench, args.data)
    if bench and not records:  # before --save-data could store nothing over a record
        p.error(
            f"--bench: {bench} holds no run of tools/bench_schedulers.py (DIR/<layout>/<workload>/<scheduler>-<n>/)"
        )
    if args.save_data:
        save_records(bench, args.data, records)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    only = args.workloads.split(",") if args.workloads else list(records)
    if unknown := sorted(set(only) - set(records)):
        p.error(f"--workloads: no {', '.join(unknown)} in this benchmark (it has {', '.join(sorted(records))})")
    records = {wl: records[wl] for wl in only}
    if capacities:
        sweep = capacity_sweep(records, capacities)
        print_capacity_sweep(sweep)
        (out / "capacity.json").write_text(json.dumps(sweep, indent=1))
        return
    if args.carry:
        table = carry_what_if(records)
        print_carry_what_if(table)
        (out / "carry.json").write_text(json.dumps(table, indent=1))
        return
    if lengths:
        table = longer_runs(records, lengths)
        print_longer_runs(table)
        (out / "longer_runs.json").write_text(json.dumps(table, indent=1))
        return
    if args.admission:
        table = admission_rules(records)
        print_admission_rules(table)
        (out / "admission.json").write_text(json.dumps(table, indent=1))
        return
    if args.free_cpus:
        table = free_cpus(records)
        print_free_cpus(table)
        (out / "free_cpus.json").write_text(json.dumps(table, indent=1))
        return
    if args.fit_from:
        source = load_records(None, args.fit_from)
        if missing := sorted(set(records) - set(source)):
            p.error(f"--fit-from {args.fit_from} has no {', '.join(missing)} (use --workloads)")
        fitted = scheduler_costs({wl: source[wl] for wl in records})
    else:
        fitted = scheduler_costs(records)
    results: dict[str, Any] = {"cross": cross_predict(records, fitted, args.fit_from),
                               "held_out": held_out(records, fitted, args.fit_from)}  # fmt: skip
    if args.fit_from:  # 1e compares each scheduler's costs on these runs: none were fitted here
        print_cross(results["cross"])
        print_held_out(results["held_out"])
        (out / "cross.json").write_text(json.dumps({k: results[k] for k in ("cross", "held_out")}, indent=1))
        return
    results["costs"] = costs_by_scheduler(records, fitted)
    if args.cross:
        print_cross(results["cross"])
        print_held_out(results["held_out"])
        print_costs(results["costs"])
        (out / "cross.json").write_text(json.dumps({k: results[k] for k in ("cross", "held_out", "costs")}, indent=1))
        return
    results["validation"] = validate({wl: c for wl, c in load_calibrations(bench, args.data).items() if wl in records})
    print_validation(results["validation"])
    print_cross(results["cross"])
    print_held_out(results["held_out"])
    print_costs(results["costs"])
    results["workload_bounds"] = workload_bounds(records)
    print_workload_bounds(results["workload_bounds"])
    settings = {
        "2.4T, 4 cells x 48 nodes x 8 GPUs": REF_24T,
        "122B, 32 nodes": ref_122b(32),
        "122B, 24 nodes": ref_122b(24),
    }
    for name, s in settings.items():
        if args.quick:
            s = {**s, "shape": replace(s["shape"], steps=12)}
        results[name] = reference(s)
        print_reference(name, results[name])
    results["grid"] = grid(steps=6 if args.quick else 12)
    pngs = heatmaps(results["grid"], out)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    worst = max(results["grid"], key=lambda g: g["over_bound"])
    print(f"\n3. Map: {len(results['grid'])} points; elastic is farthest from the bound at tail {worst['tail']}, "
          f"ratio {worst['ratio']}, {worst['cells']} cells ({worst['over_bound']:.2f}x); heatmaps: "
          f"{', '.join(str(p) for p in pngs)}")  # fmt: skip
    print_policy_change(results["grid"])
    print(f"sim_schedulers: {out / 'results.json'} in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
