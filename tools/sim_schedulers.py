"""Elastic vs colocate vs async in the simulator (gyre.sim): validation, the reference system's scale, a map.

    python -m tools.sim_schedulers [--out DIR] [--bench DIR [--save-data]] [--quick] [--cross]

1. Validation: every run of the local benchmark (tools/bench_schedulers.py, layout disjoint2, three
   workloads) is simulated from its own calibration (its sessions, micro-batches, switches, steps, the
   controller's shard writes), fitted now from the run's records; the medians over repeats beside the
   measured medians, and what the model gives without the shard writes. The records of the recorded
   benchmark are in tools/sim_data/bench17_runs.json.gz; `--bench DIR` reads a benchmark's output
   directory instead (DIR/<workload>/<scheduler>-<repeat>/), `--save-data` stores its records there.
   1b. Cross-prediction: calibrated on one scheduler's runs alone, the other schedulers' walls predicted
   (`--cross` prints only this). 1c. One lower bound per workload, the same for every scheduler, and
   each scheduler's distance from it.
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
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from gyre.config.schema import CELL_SCHEDULERS as SCHEDULERS
from gyre.sched.policy import KEEP_TRAINING
from gyre.sim.bound import alone_seconds, lower_bound, workload_bound
from gyre.sim.calibrate import Calibration, RunRecord, calibrate, calibrate_predictive, read_run, workload_facts
from gyre.sim.simulator import SimResult, simulate
from gyre.sim.workload import CellModel, RunShape, Workload

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tools" / "sim_data" / "bench17_runs.json.gz"
WORKLOADS = {"sigma0.5": "tool-time tail sigma=0.5", "sigma1.0": "sigma=1.0", "trainheavy": "training ~ rollouts"}
HOUR = 3600.0
PREDICTIVE = "tool sleeps as the harness draws them; CPU work, engine and training costs with the source's contention divided out"

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
def load_calibrations(bench: Path | None) -> dict[str, dict[str, Calibration]]:
    """workload -> run name -> the run's own calibration, fitted now from its records (the stored benchmark
    in DATA, or a bench_schedulers output directory laid out as bench/<workload>/<scheduler>-<n>/)."""
    return {wl: {name: calibrate([rec]) for name, rec in runs.items()} for wl, runs in load_records(bench).items()}


def load_records(bench: Path | None) -> dict[str, dict[str, RunRecord]]:
    if bench is not None:
        return {
            wl: {d.name: read_run(d) for d in sorted((bench / wl).iterdir()) if (d / "summary.json").exists()}
            for wl in WORKLOADS
            if (bench / wl).is_dir()
        }
    data = json.loads(gzip.decompress(DATA.read_bytes()))
    out = {wl: {name: RunRecord.from_json(r) for name, r in d["runs"].items()} for wl, d in data.items()}
    for wl, runs in out.items():
        facts = facts_of_bench_args(data[wl]["bench_args"])
        for r in runs.values():
            r.shape = {**facts, **r.shape}  # records from before they carried these (gyre.sim.calibrate.workload_facts)
    return out


def facts_of_bench_args(args: list[str]) -> dict[str, Any]:
    """The tool sleep and shared CPUs of a stored benchmark's runs, from the arguments it ran with (over
    tools/bench_schedulers.py's workload)."""
    from tools.bench_schedulers import WORKLOAD

    given = dict(a.split("=", 1) for a in [*WORKLOAD, *args])
    cfg = {"sched": {"cpu_sets": given.get("sched.cpu_sets", "[]").strip("[]").split(",")},
           "tasks": {"tool_time_s": float(given.get("tasks.tool_time_s", 0.0)),
                     "tool_time_sigma": float(given.get("tasks.tool_time_sigma", 1.0))}}  # fmt: skip
    cfg["sched"]["cpu_sets"] = [c for c in cfg["sched"]["cpu_sets"] if c]
    return workload_facts(cfg)


def save_records(bench: Path) -> None:
    """Store a benchmark's run records (what calibration reads from each run directory) as DATA."""
    data = {}
    for wl, runs in load_records(bench).items():
        args = (
            json.loads((bench / wl / "results.json").read_text())["extra"]
            if (bench / wl / "results.json").exists()
            else []
        )
        data[wl] = {"bench_args": args, "runs": {name: r.to_json() for name, r in runs.items()}}
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_bytes(gzip.compress(json.dumps(data).encode()))
    print(f"sim_schedulers: {sum(len(d['runs']) for d in data.values())} run records in {DATA}")


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
    print("\n1. Validation: local benchmark (2 one-CPU cells), each run simulated from its own calibration")
    print(f"{'workload':24s} {'scheduler':15s} {'measured s':>10s} {'simulated s':>11s} {'error':>7s} {'bound s':>8s} "
          f"{'no shard writes':>15s} {'shard write':>11s}")  # fmt: skip
    for wl, rows in table.items():
        for sched in SCHEDULERS:
            r = rows[sched]
            off = r["no_shard_writes_s"] / r["measured_s"] - 1
            print(f"{WORKLOADS[wl]:24s} {sched:15s} {r['measured_s']:10.1f} {r['simulated_s']:11.1f} "
                  f"{r['error']:+7.1%} {r['bound_s']:8.1f} {r['no_shard_writes_s']:7.1f} ({off:+5.1%}) "
                  f"{r['group_write_s']:9.2f} s")  # fmt: skip
        runs = "; ".join(f"{s} {rows[s]['measured_runs']}" for s in SCHEDULERS)
        print(f"{'':24s} same order: {rows['same_order']} (measured {' < '.join(rows['order']['measured_s'])}); "
              f"measured runs: {runs}")  # fmt: skip


def cross_predict(records: dict[str, dict[str, RunRecord]], predictive: bool = False) -> dict[str, Any]:
    """Calibrate on one scheduler's runs of a workload alone and predict every scheduler's wall on it;
    `predictive`: with gyre.sim.calibrate.calibrate_predictive (the source's contention divided out, the
    target's simulated on the shared CPUs), else with each rollout replayed as the source measured it.

    The validation above replays each run from its own records, so it cannot tell a model that predicts
    from one that copies; here the off-diagonal cells (a scheduler the calibration never saw) are the test.
    Returns workload -> calibrated-on -> predicted scheduler -> {measured_s, simulated_s, error}, plus the
    median and worst absolute error off the diagonal."""
    table: dict[str, Any] = {}
    off: list[float] = []
    for wl, runs in records.items():
        walls = {s: statistics.median(r.wall_s for r in runs.values() if r.scheduler == s) for s in SCHEDULERS}
        rows: dict[str, Any] = {}
        for src in SCHEDULERS:
            mine = [r for r in runs.values() if r.scheduler == src]
            cal = calibrate_predictive(mine) if predictive else calibrate(mine)
            rows[src] = {}
            for tgt in SCHEDULERS:
                sim = simulate(tgt, cal.cell, cal.shape, cal.trace()).wall_s
                err = sim / walls[tgt] - 1
                rows[src][tgt] = {
                    "measured_s": round(walls[tgt], 2),
                    "simulated_s": round(sim, 2),
                    "error": round(err, 4),
                }
                if tgt != src:
                    off.append(abs(err))
        table[wl] = rows
    return {"table": table, "median_error": round(statistics.median(off), 4), "worst_error": round(max(off), 4),
            "repeat_noise": repeat_noise(records)}  # fmt: skip


def repeat_noise(records: dict[str, dict[str, RunRecord]]) -> dict[str, float] | None:
    """What the same scheduler's repeats say about the data: each run, simulated from its own calibration,
    against every other repeat of its scheduler on its workload (median and worst absolute error). A
    cross-prediction cannot be judged finer than this: the runs themselves disagree by as much."""
    errors = []
    for runs in records.values():
        for name, run in runs.items():
            others = [r.wall_s for n, r in runs.items() if n != name and r.scheduler == run.scheduler]
            if others:
                cal = calibrate([run])
                sim = simulate(run.scheduler, cal.cell, cal.shape, cal.trace()).wall_s
                errors += [abs(sim / w - 1) for w in others]
    if not errors:
        return None
    return {"median_error": round(statistics.median(errors), 4), "worst_error": round(max(errors), 4), "n": len(errors)}


def print_cross(cross: dict[str, Any], title: str = "each rollout replayed as measured") -> None:
    print(f"\n1b. Cross-prediction ({title}): calibrated on one scheduler's runs alone, each scheduler's wall "
          "predicted (error against its measured median; the diagonal, in brackets, was fitted)")  # fmt: skip
    print(f"{'workload':24s} {'calibrated on':15s} " + " ".join(f"{s:>15s}" for s in SCHEDULERS))
    for wl, rows in cross["table"].items():
        for src in SCHEDULERS:
            cells = [f"({e:+.1%})" if t == src else f"{e:+.1%}" for t in SCHEDULERS for e in [rows[src][t]["error"]]]
            print(f"{WORKLOADS.get(wl, wl):24s} {src:15s} " + " ".join(f"{c:>15s}" for c in cells))
    print(f"off the diagonal: median error {cross['median_error']:.1%}, worst {cross['worst_error']:.1%}")
    if noise := cross["repeat_noise"]:
        print(f"the data's own spread: a run's replay against the other repeats of its scheduler, median "
              f"{noise['median_error']:.1%}, worst {noise['worst_error']:.1%} ({noise['n']} pairs)")  # fmt: skip


def workload_bounds(records: dict[str, dict[str, RunRecord]]) -> dict[str, Any]:
    """Each workload's one bound (gyre.sim.bound.workload_bound) and every scheduler's distance from it, beside
    the bound each scheduler's own runs give (what over_bound used to compare)."""
    out: dict[str, Any] = {}
    for wl, runs in records.items():
        bound = workload_bound(list(runs.values()))
        rows: dict[str, Any] = {"bound_s": round(bound.seconds, 2), "chain_s": round(bound.chain_s, 2),
                                "work_s": round(bound.work_s, 2)}  # fmt: skip
        for sched in SCHEDULERS:
            mine = [r for r in runs.values() if r.scheduler == sched]
            wall = statistics.median(r.wall_s for r in mine)
            own = statistics.median(
                lower_bound(c.cell, c.shape, c.trace()).seconds for c in (calibrate([r]) for r in mine)
            )
            rows[sched] = {"measured_s": round(wall, 2), "over_bound": round(wall / bound.seconds, 3),
                           "own_bound_s": round(own, 2), "over_own_bound": round(wall / own, 3)}  # fmt: skip
        out[wl] = rows
    return out


def print_workload_bounds(bounds: dict[str, Any]) -> None:
    print("\n1c. One bound per workload (each rollout as quick as any run saw it; engine and training costs from "
          "all runs): each scheduler's median wall over it, and over the bound of its own runs")  # fmt: skip
    for wl, rows in bounds.items():
        parts = [f"{s} {rows[s]['over_bound']:.2f}x (own {rows[s]['over_own_bound']:.2f}x of {rows[s]['own_bound_s']:.0f} s)"
                 for s in SCHEDULERS]  # fmt: skip
        print(f"{WORKLOADS.get(wl, wl):24s} bound {rows['bound_s']:6.1f} s (chain {rows['chain_s']:.0f}, "
              f"work {rows['work_s']:.0f}): " + "; ".join(parts))  # fmt: skip


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "outputs" / "sim_schedulers"))
    p.add_argument("--bench", default=None, help="refit the validation from a bench_schedulers output directory")
    p.add_argument("--save-data", action="store_true", help=f"store the run records of --bench as {DATA.name}")
    p.add_argument("--quick", action="store_true", help="a smaller map (6 steps) and the reference at 12 steps")
    p.add_argument("--cross", action="store_true", help="print only the cross-prediction table (1b) and stop")
    args = p.parse_args()
    if args.save_data:
        if not args.bench:
            p.error("--save-data stores the runs of --bench DIR")
        save_records(Path(args.bench))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    bench = Path(args.bench) if args.bench else None
    results: dict[str, Any] = {"cross": cross_predict(load_records(bench))}
    results["cross_predictive"] = cross_predict(load_records(bench), predictive=True)
    if args.cross:
        print_cross(results["cross"])
        print_cross(results["cross_predictive"], PREDICTIVE)
        (out / "cross.json").write_text(json.dumps({k: results[k] for k in ("cross", "cross_predictive")}, indent=1))
        return
    results["validation"] = validate(load_calibrations(bench))
    print_validation(results["validation"])
    print_cross(results["cross"])
    print_cross(results["cross_predictive"], PREDICTIVE)
    results["workload_bounds"] = workload_bounds(load_records(bench))
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
