"""A checkpoint, a model.path HF directory or the warm start evaluated on its own (launch/eval.py).

The same controller and cell as a run (gyre.sched.launch.in_process: scheduler=colocate, one cell in this process),
started at the checkpoint's weight version with no step left to train: it runs one eval (gyre.sched.controller.evaluation)
and finishes. The numbers, the shards and the per-task table are those an in-run eval of the same weight
version and seed writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gyre.config.schema import RunConfig
from gyre.errors import UserError
from gyre.resume.recovery import ResumePoint
from gyre.resume.state import RunState, read_state


def starting_point(cfg: RunConfig) -> ResumePoint:
    """eval.checkpoint's state (its weight version), else version 0 of model.path or the warm start."""
    if not cfg.eval.checkpoint:
        return ResumePoint(RunState(), None)
    directory = Path(cfg.eval.checkpoint)
    state = read_state(directory)
    if state is None:
        raise UserError(f"eval.checkpoint={directory}: no complete checkpoint there (state.json and its files); "
                        "give a run's checkpoint/ directory")  # fmt: skip
    return ResumePoint(state, directory)


def evaluate(cfg: RunConfig, out: Path) -> dict[str, Any]:
    """Run one eval of the starting point's weights; returns its metrics row."""
    from gyre.sched.launch.in_process import run_in_process, runs_in_process

    cfg.scheduler, cfg.cluster.satellites = "colocate", []  # one local cell serves an eval; nothing trains
    if not runs_in_process(cfg):
        raise UserError("launch.eval runs one local cell of one rank: set cluster.core.nodes=1 and "
                        "cluster.core.tasks_per_node=1")  # fmt: skip
    point = starting_point(cfg)
    version = point.state.next_step
    cfg.eval.every = cfg.eval.every or 1  # any non-zero: the eval is due at the last (here: the only) version
    object.__setattr__(cfg, "steps", version)  # nothing to train: the run is its one eval (steps may be 0 here)
    out.mkdir(parents=True, exist_ok=True)
    run_in_process(cfg, out, point)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if r.get("event") == "eval" and r["version"] == version]
    if not evals:
        raise RuntimeError(f"the eval of version {version} wrote no metrics row in {out / 'metrics.jsonl'}")
    return evals[-1]


def table_text(out: Path, row: dict[str, Any]) -> str:
    """The per-task table and the eval's numbers, as printed."""
    tasks = json.loads((out / row["task_table"]).with_suffix(".json").read_text())
    width = max([len("task"), *(len(t["task_id"]) for t in tasks)])
    lines = [f"{'task':<{width}}  {'family':<14} samples graded successes pass@1 reward"]
    for t in tasks:
        p1 = "-" if t["pass@1"] is None else f"{t['pass@1']:.2f}"
        reward = "-" if t["mean_reward"] is None else f"{t['mean_reward']:.2f}"
        lines.append(f"{t['task_id']:<{width}}  {t['family']:<14} {t['samples']:>7} {t['graded']:>6} "
                     f"{t['successes']:>9} {p1:>6} {reward:>6}")  # fmt: skip
    ks = sorted(int(k[5:]) for k in row if k.startswith("pass@"))
    passes = ", ".join(f"pass@{k} {row[f'pass@{k}']:.3f}" for k in ks if row[f"pass@{k}"] is not None)
    reward = "n/a" if row["mean_reward"] is None else f"{row['mean_reward']:.3f}"
    lines.append(f"gyre eval: weight version {row['version']}: {passes}; mean reward {reward}; "
                 f"{row['n_tasks']} tasks, {row['n_samples']} samples, {row['excluded']} excluded")  # fmt: skip
    return "\n".join(lines)
