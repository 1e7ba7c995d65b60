"""The controller's record of each step: its sessions as they finish, its group shards, its metrics.

A group's shard is written the moment its last session is graded (gyre.pipeline.write_group_shard),
and its micro-batches are planned from the shard at once, both on the writer's thread
(gyre.sched.controller.group_writer), so training can start on it while the step's other groups still
run and the controller's loop never waits for it. A resumed run's first step starts with the groups it kept from the
interrupted start (gyre.resume.kept_groups): their shards are planned when the step opens, and only
the other groups' sessions run.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.comm.messages import MicroBatchRef
from gyre.config.schema import RunConfig
from gyre.harness.runner import RolloutOutcome
from gyre.health import count_reasons
from gyre.metrics import mean
from gyre.pipeline import FinishedRollout, GroupShard
from gyre.proxy.call_log import CallRecord
from gyre.resume.kept_groups import KeptGroup, restore_groups
from gyre.sandbox.backends import check_task_images
from gyre.sched.controller.group_writer import GroupJob, WrittenGroup
from gyre.sched.controller.sessions import SessionDone, SessionJob
from gyre.sched.replica import plan_group
from gyre.tasks.suite import TaskPool


@dataclass
class StepRecord:
    step: int
    jobs: list[SessionJob]
    submitted: float = field(default_factory=time.monotonic)
    groups: dict[int, list[FinishedRollout]] = field(default_factory=lambda: defaultdict(list))
    shards: list[GroupShard] = field(default_factory=list)
    trainable: int = 0  # rollouts with a non-zero advantage
    loss_rollouts: int = 0  # |R|: rollouts the step's loss is averaged over (rl.loss_norm)
    trained_ids: list[str] = field(default_factory=list)
    micro_batches: int = 0
    train_metrics: list[dict[str, float]] = field(default_factory=list)
    train_metrics_by_cell: dict[int, list[dict[str, float]]] = field(default_factory=dict)  # the same, by cell
    rollouts_done_at: float = 0.0
    kept_groups: list[int] = field(default_factory=list)  # completed before a restart: restored, not run again

    @property
    def group_size(self) -> int:
        return len(self.jobs) // max(1, len({j.group for j in self.jobs}))

    @property
    def all_shards_written(self) -> bool:
        return len(self.shards) == len({j.group for j in self.jobs})


class StepBook:
    def __init__(self, cfg: RunConfig, out: Path, kept: dict[int, KeptGroup] | None = None) -> None:
        self.cfg = cfg
        self.out = out
        self.kept = kept or {}  # groups of the first step this start runs, kept from the interrupted one
        self.shard_dir = out / "shards"
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        self.pool = TaskPool.from_config(cfg.tasks, seed=cfg.seed)
        check_task_images(cfg.sandbox, [t.image for t in self.pool.tasks])
        self.steps: dict[int, StepRecord] = {}

    def open(self, step: int) -> tuple[list[SessionJob], list[list[MicroBatchRef]]]:
        """The step's sessions to run, and the micro-batches of the groups kept from an interrupted start."""
        rl = self.cfg.rl
        tasks = self.pool.for_step(step, rl.groups_per_step)
        jobs = [SessionJob(step, g, t, f"s{step}-g{g}-r{i}") for g, t in enumerate(tasks) for i in range(rl.group_size)]
        rec = self.steps[step] = StepRecord(step, jobs)
        kept = {g: k for g, k in self.kept.items() if k.step == step}
        batches = []
        for g, restored in restore_groups(kept, tasks, self.out).items():
            rec.groups[g].extend(restored.members)
            rec.kept_groups.append(g)
            batches.append(self._add_shard(rec, restored.shard))
        if sum(len(m) for m in rec.groups.values()) == len(jobs):
            rec.rollouts_done_at = time.monotonic()
        return [j for j in jobs if j.group not in kept], batches

    def finished(self, done: SessionDone, calls: list[CallRecord], workdirs: Path) -> GroupJob | None:
        """Record a finished session; when it completes its group, the group to write
        (gyre.sched.controller.group_writer, which orders its members by rollout id)."""
        if done.error or done.outcome is None:
            raise RuntimeError(f"rollout {done.job.rollout_id} could not run: {done.error}")
        rec = self.steps[done.job.step]
        members = rec.groups[done.job.group]
        members.append(FinishedRollout(done.job.group, done.outcome, calls))
        if sum(len(m) for m in rec.groups.values()) == len(rec.jobs):
            rec.rollouts_done_at = time.monotonic()
        if len(members) < rec.group_size:
            return None
        return GroupJob(rec.step, done.job.group, list(members), self.pool.skipped_causes(), workdirs)

    def add_written(self, written: WrittenGroup) -> list[MicroBatchRef]:
        """A group's shard is written and planned: count it in its step; returns its micro-batches."""
        rec = self.steps[written.step]
        return self._add_shard(rec, written.shard, (written.refs, written.trained, written.loss_rollouts))

    def _add_shard(
        self, rec: StepRecord, shard: GroupShard, plan: tuple[list[MicroBatchRef], list[str], int] | None = None
    ) -> list[MicroBatchRef]:
        """Count a completed group's shard and its micro-batches (planned here unless `plan`) in its step."""
        rec.shards.append(shard)
        refs, trained, n_loss = plan or plan_group(shard.path, self.cfg)
        rec.trainable += len(trained)
        rec.loss_rollouts += n_loss
        rec.trained_ids += trained
        rec.micro_batches += len(refs)
        return refs

    def summary(self, step: int) -> dict[str, Any]:
        rec = self.steps[step]
        finished = [r for g in sorted(rec.groups) for r in rec.groups[g]]
        calls = [c for r in finished for c in r.calls]
        lags = [step - int(c.weight_version) for c in calls if c.weight_version.isdigit()]
        tokens, path_tokens = sum(s.tokens for s in rec.shards), sum(s.path_tokens for s in rec.shards)
        train = _mean_metrics(rec.train_metrics)
        return {
            **outcome_summary([r.outcome for r in finished]),
            "n_calls": len(calls),
            "policy_tokens": sum(len(c.output_ids) for c in calls),
            **{f"train/{k}": v for k, v in train.items()},
            "tree_tokens": float(tokens),
            "call_tokens_per_tree_token": path_tokens / tokens if tokens else 1.0,
            "excluded_from_training": float(sum(len(s.excluded) for s in rec.shards)),
            "trainable_rollouts": rec.trainable,
            "micro_batches": rec.micro_batches,
            "behaviour_lag_max": max(lags, default=0),
            "behaviour_lag_mean": statistics.fmean(lags) if lags else 0.0,
            "rollout_s": round(rec.rollouts_done_at - rec.submitted, 3) if rec.rollouts_done_at else None,
            "kept_groups": sorted(rec.kept_groups),
            # rl.mismatch's diagnostics of each cell's own micro-batches: its engine's and its trainer's numerics
            "mismatch_by_cell": {
                str(c): {k: v for k, v in _mean_metrics(rows).items() if k.startswith("mismatch/")}
                for c, rows in sorted(rec.train_metrics_by_cell.items())
            },
        }


def outcome_summary(outcomes: list[RolloutOutcome]) -> dict[str, Any]:
    """The step's rollouts as a step row reports them (gyre.health reads them), computed
    here so that the controller never imports the trainer."""
    graded = [o for o in outcomes if o.grade.status != "failed"]
    return {
        "n_rollouts": len(outcomes),
        "n_scored": len(graded),
        "n_excluded": len(outcomes) - len(graded),
        "n_timeouts": sum(1 for o in outcomes if o.grade.status == "timeout"),
        "reward_mean": mean([o.grade.score for o in graded]),
        "success_rate": mean([1.0 if o.grade.success else 0.0 for o in graded]),
        "turns_mean": mean([float(o.turns) for o in outcomes]),
        "turns_max": max((o.turns for o in outcomes), default=0),
        "rollout_wall_max_s": max((o.wall_s for o in outcomes), default=0.0),
        "excluded_reasons": sorted({o.grade.reason for o in outcomes if o.grade.status == "failed"}),
        "excluded_reason_counts": count_reasons(o.grade.reason for o in outcomes if o.grade.status == "failed"),
        "n_agent_failed": sum(1 for o in outcomes if o.grade.status == "agent_failed"),
    }


def _mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for r in rows for k in r}
    return {k: statistics.fmean(r[k] for r in rows if k in r) for k in sorted(keys)}
