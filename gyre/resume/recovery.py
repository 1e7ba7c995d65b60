"""Deciding where a run starts, and moving aside what unfinished steps left in its output directory.

`resume` (RunConfig.resume):
- auto (default): continue from `output_dir/checkpoint/` when it holds a complete checkpoint,
  else start at step 0. `make run` without output_dir gets a fresh Hydra directory, so it starts
  over; the same output_dir again (a Slurm requeue, a second `make run output_dir=...`) continues.
- must: continue, or fail when there is no complete checkpoint.
- never: start at step 0; an earlier run's outputs there, checkpoint included, are moved aside.

Outputs of steps at or after the starting step (shards and shard temp files, metrics rows,
call-log lines, rollout workspaces) belong to no checkpoint: they were written by a start that
was stopped before checkpointing them. They are moved into `output_dir/preempted/<name>/` with a
manifest.json, never deleted, and the steps are run again with the same rollout ids. Except the
completed groups of the starting step itself whose shards were served by the checkpoint's weights
(gyre.resume.kept_groups): their shards and call-log lines stay, and the step runs only the others.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre.config.schema import ResumeMode, RunConfig
from gyre.errors import UserError
from gyre.resume.state import RunState, checkpoint_paths, find_checkpoint, read_state

SET_ASIDE_DIR = "preempted"
SHARD_STEP = re.compile(r"^\.?step(\d+)-")  # step00003-group0001.h5 and the writer's hidden temp files
WORKSPACE_STEP = re.compile(r"^step(\d+)$")  # rollouts/step0003/
ROLLOUT_STEP = re.compile(r"^s(\d+)-")  # rollout ids s<step>-g<group>-r<index> (gyre/sched/controller/steps.py)

if TYPE_CHECKING:
    from gyre.resume.kept_groups import KeptGroup


class ResumeError(UserError, RuntimeError):
    """The run cannot start as asked (resume=must without a checkpoint, an unknown mode)."""


@dataclass
class ResumePoint:
    state: RunState  # the checkpoint's state, or a fresh one
    checkpoint: Path | None  # the checkpoint directory to load; None: start at step 0
    set_aside: Path | None = None  # where outputs of unfinished steps went, if anything was moved
    moved: dict[str, Any] = field(default_factory=dict)
    metrics_rows: list[dict[str, Any]] = field(default_factory=list)  # rows of the completed steps
    kept: dict[int, KeptGroup] = field(default_factory=dict)  # completed groups of step next_step, by group


def prepare_resume(output_dir: Path, mode: str, log: Callable[[str], None] = print) -> ResumePoint:
    """Pick the starting point for `output_dir` and move aside everything after it."""
    if mode not in tuple(ResumeMode):
        raise ResumeError(f"resume={mode!r} is not a mode; use one of {', '.join(ResumeMode)}")
    checkpoint = find_checkpoint(output_dir)
    if mode == ResumeMode.must and checkpoint is None:
        raise ResumeError(
            f"resume=must but {output_dir / 'checkpoint'} holds no complete checkpoint (state.json missing); "
            "run with resume=auto to start at step 0, or point output_dir at the run to continue"
        )
    if mode == "never":
        checkpoint = None
    state = read_state(checkpoint) if checkpoint is not None else None
    point = ResumePoint(state or RunState(), checkpoint)
    if mode != "never":
        from gyre.resume.kept_groups import find_kept_groups  # h5py: only when resuming

        point.kept = find_kept_groups(output_dir, point.state.next_step, point.state.weight_version)
    aside = output_dir / SET_ASIDE_DIR / f"step{point.state.next_step:05d}-{time.strftime('%Y%m%d-%H%M%S')}"
    kept = {p for k in point.kept.values() for p in (k.shard.name, *k.rollout_ids)}
    point.moved, point.metrics_rows = set_aside_from(output_dir, point.state.next_step, aside, mode == "never", kept)
    point.set_aside = aside if point.moved else None
    if point.moved:
        (aside / "manifest.json").write_text(json.dumps(_manifest(point, mode), indent=1))
        counts = ", ".join(f"{len(v) if isinstance(v, list) else v} {k}" for k, v in point.moved.items())
        log(f"gyre: moved outputs of unfinished steps >= {point.state.next_step} aside to {aside} ({counts})")
    if point.kept:
        log(f"gyre: keeping the completed groups {sorted(point.kept)} of step {point.state.next_step} (their shards, "
            f"served by weight version {point.state.weight_version}); running only the others")  # fmt: skip
    return point


def describe_start(point: ResumePoint, cfg: RunConfig, output_dir: Path) -> str:
    """The log line of this start: fresh or resumed, from where, under which Slurm job and restart."""
    state = point.state
    latest = state.starts[-1] if state.starts else {}
    slurm = ""
    if "slurm_job_id" in latest:
        slurm = f" (Slurm job {latest['slurm_job_id']}, restart {latest.get('slurm_restart_count', '0')})"
    if point.checkpoint is None:
        return f"gyre: starting {output_dir} at step 0 (resume={cfg.resume}, no checkpoint used){slurm}"
    lines = [
        f"gyre: resuming {output_dir} from {point.checkpoint} at step {state.next_step} of {cfg.steps}, "
        f"weight version {state.weight_version}, {len(state.ledger)} completed steps, start {len(state.starts)}{slurm}"
    ]
    before, now = state.data, task_pool_position(cfg, state.next_step)
    changed = sorted(k for k in now if k in before and before[k] != now[k])
    if changed:
        lines.append(
            "gyre: warning: the task pool differs from the checkpoint's "
            + ", ".join(f"{k} {before[k]} -> {now[k]}" for k in changed)
            + "; later steps see other tasks than the interrupted run would have"
        )
    return "\n".join(lines)


def checkpoint_due(cfg: RunConfig, step: int) -> bool:
    """Whether the run checkpoints once `step` is completed: every checkpoint_every steps (default 1: each
    step, written in the background) and after the last."""
    every = cfg.checkpoint_every
    return bool(every and (step + 1) % every == 0) or step + 1 == cfg.steps


def task_pool_position(cfg: RunConfig, next_step: int) -> dict[str, Any]:
    """Where the run is in its task pool. TaskPool.for_step is a pure function of (seed, step), so
    this is derived from next_step; it is saved to notice a resume with another pool."""
    return {
        "seed": cfg.seed,
        "source": cfg.tasks.source,
        "path": cfg.tasks.path,
        "split": cfg.tasks.split,
        "families": list(cfg.tasks.families),
        "pool_size": cfg.tasks.pool_size,
        "groups_per_step": cfg.rl.groups_per_step,
        "tasks_taken": next_step * cfg.rl.groups_per_step,
    }


def set_aside_from(
    output_dir: Path,
    first_step: int,
    aside: Path,
    with_checkpoint: bool = False,
    keep: set[str] | frozenset = frozenset(),
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Move outputs of steps >= first_step under `aside`, but the shards and rollout ids' call-log lines named in
    `keep`; returns (what moved, metrics rows kept)."""
    moved: dict[str, Any] = {}
    shards = [
        p
        for p in _files(output_dir / "shards", SHARD_STEP)
        if _step(p.name, SHARD_STEP) >= first_step and p.name not in keep
    ]
    workspaces = [
        p for p in _files(output_dir / "rollouts", WORKSPACE_STEP) if _step(p.name, WORKSPACE_STEP) >= first_step
    ]
    for kind, paths in (("shards", shards), ("rollout workspaces", workspaces)):
        if paths:
            target = aside / Path(paths[0]).parent.name
            target.mkdir(parents=True, exist_ok=True)
            for p in paths:
                shutil.move(p, target / p.name)
            moved[kind] = sorted(p.name for p in paths)
    kept_rows: list[dict[str, Any]] = []
    n_rows = _split_jsonl(output_dir / "metrics.jsonl", aside, lambda row: row.get("step", -1) < first_step, kept_rows)
    if n_rows:
        moved["metrics rows"] = n_rows
    n_calls = _split_jsonl(
        output_dir / "calls.jsonl", aside, lambda call: _call_step(call) < first_step or call.get("rollout_id") in keep
    )
    if n_calls:
        moved["call-log lines"] = n_calls
    current, old, tmp = checkpoint_paths(output_dir)
    shutil.rmtree(tmp, ignore_errors=True)  # an unfinished checkpoint write: incomplete by definition
    if with_checkpoint:
        names = [p.name for p in (current, old) if p.exists()]
        for name in names:
            aside.mkdir(parents=True, exist_ok=True)
            shutil.move(output_dir / name, aside / name)
        if names:
            moved["checkpoints"] = names
    return moved, kept_rows


def _files(directory: Path, pattern: re.Pattern[str]) -> Iterator[Path]:
    if directory.is_dir():
        yield from (p for p in directory.iterdir() if pattern.match(p.name))


def _step(name: str, pattern: re.Pattern[str]) -> int:
    match = pattern.match(name)
    assert match is not None
    return int(match[1])


def _call_step(call: dict[str, Any]) -> int:
    match = ROLLOUT_STEP.match(str(call.get("rollout_id", "")))
    return int(match[1]) if match else -1  # ids of other shapes are kept


def _split_jsonl(path: Path, aside: Path, keep: Callable[[dict[str, Any]], bool], kept_rows: list | None = None) -> int:
    """Rewrite `path` (atomically) with the lines `keep` accepts; the others go to aside/<name>."""
    if not path.exists():
        return 0
    tmp = path.with_name(path.name + ".tmp")
    n_moved = 0
    moved_file = None
    with path.open() as src, tmp.open("w") as dst:
        for line in src:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None  # a line cut short by the stop: it belongs to no completed step
            if row is not None and keep(row):
                dst.write(line if line.endswith("\n") else line + "\n")
                if kept_rows is not None:
                    kept_rows.append(row)
                continue
            if moved_file is None:
                aside.mkdir(parents=True, exist_ok=True)
                moved_file = (aside / path.name).open("a")
            moved_file.write(line if line.endswith("\n") else line + "\n")
            n_moved += 1
    if moved_file is not None:
        moved_file.close()
    if n_moved:
        os.replace(tmp, path)
    else:
        tmp.unlink()
    return n_moved


def _manifest(point: ResumePoint, mode: str) -> dict[str, Any]:
    why = (
        "resume=never: an earlier run's outputs in this directory; this run starts over at step 0"
        if mode == "never"
        else "written by a start of this run that stopped before checkpointing these steps; "
        "the resumed run runs them again with the same rollout ids"
    )
    return {
        "why": why,
        "resume": mode,
        "first_step": point.state.next_step,
        "checkpoint": str(point.checkpoint) if point.checkpoint else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "moved": point.moved,
        "kept": {str(g): k.shard.name for g, k in sorted(point.kept.items())},
    }
