"""Evaluation during a run: every eval.every steps (and before the first), each eval task sampled
eval.samples times with the weights of one version, through the run's harness, proxy, sandbox and grader.

Eval sessions are rollout work of the lowest priority: gyre.sched.controller.sessions gives them only slots no
training session wants and preempts them (to run again) when one does, so under the cell schedulers they
never hold up a step; the controller abandons an eval still in flight when the next comes due. Their shards
go to shards_eval/ (kind=eval, every rollout excluded from training), written off the controller's loop by
the group writer (gyre.sched.controller.group_writer), and never reach a group's advantage or the trainer.
Each finished eval is one metrics row (`event: eval`), once its last shard is written.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

from gyre.config.schema import RunConfig
from gyre.eval.metrics import Sample, summarize, summarize_by_family, task_table
from gyre.eval.tasks import eval_task_set
from gyre.harness.runner import RolloutOutcome
from gyre.pipeline import FinishedRollout
from gyre.proxy.call_log import CallRecord
from gyre.sched.controller.group_writer import GroupJob, WrittenGroup
from gyre.sched.controller.sessions import SessionDone, SessionJob
from gyre.tasks.suite import TaskPool
from gyre.tasks.task import Task


def sample_of(outcome: RolloutOutcome) -> Sample:
    grade = outcome.grade
    return Sample(outcome.task.task_id, outcome.task.family, grade.success, grade.score)


class EvalRunner:
    """The eval tasks of the run and the one eval in flight (evals never overlap)."""

    def __init__(self, cfg: RunConfig, out: Path, training: TaskPool | None = None) -> None:
        self.cfg = cfg
        self.tasks: list[Task] = eval_task_set(cfg, training)
        self.harness = dataclasses.replace(cfg.harness, temperature=cfg.eval.temperature)
        self.shard_dir = out / "shards_eval"
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        self.workdirs = out / "rollouts"
        self.version: int | None = None  # the weight version being evaluated
        self.groups: dict[int, list[FinishedRollout]] = defaultdict(list)
        self.done: list[RolloutOutcome] = []
        self.shards: list[str] = []
        self.writing = 0  # shards of this eval handed to the writer, not yet back
        self.versions_seen: set[str] = set()

    @property
    def in_flight(self) -> bool:
        return self.version is not None

    def due(self, version: int) -> bool:
        """Before the first step, every `every` steps, and after the last."""
        every = self.cfg.eval.every
        return bool(every) and (version % every == 0 or version == self.cfg.steps)

    def open(self, version: int) -> list[SessionJob]:
        self.version, self.done, self.shards, self.versions_seen = version, [], [], set()
        self.groups, self.writing = defaultdict(list), 0
        n = self.cfg.eval.samples
        return [
            SessionJob(version, t, task, f"e{version}-t{t}-r{i}", kind="eval", harness=self.harness)
            for t, task in enumerate(self.tasks)
            for i in range(n)
        ]

    def abandon(self, newer: int) -> dict[str, Any]:
        """Give the eval in flight up for the eval of `newer` weights (its sessions are dropped by the caller);
        returns the metrics row that says so. Its shards and workspaces are removed (a shard still being written
        once it is back: `written`): no row refers to them."""
        assert self.version is not None
        row = {"event": "eval_abandoned", "version": self.version, "replaced_by": newer}
        row |= {"samples_done": len(self.done), "samples": len(self.tasks) * self.cfg.eval.samples}
        for name in self.shards:
            (self.shard_dir / name).unlink(missing_ok=True)
        if not self.cfg.harness.keep_workspaces:
            shutil.rmtree(self.workdirs / f"eval{self.version:04d}", ignore_errors=True)
        self.version = None
        return row

    def finished(self, done: SessionDone, calls: list[CallRecord]) -> GroupJob | None:
        """Record one eval session; once its task's samples are all in, their shard's job for the group writer
        (its written shard comes back through `written`)."""
        if done.job.step != self.version:
            return None  # it finished just before its eval was abandoned
        if done.error or done.outcome is None:
            raise RuntimeError(f"eval rollout {done.job.rollout_id} could not run: {done.error}")
        self.versions_seen |= {c.weight_version for c in calls}
        members = self.groups[done.job.group]
        members.append(FinishedRollout(done.job.group, done.outcome, calls))
        self.done.append(done.outcome)
        if len(members) < self.cfg.eval.samples:
            return None
        self.writing += 1
        workdirs = self.workdirs / f"eval{self.version:04d}"
        return GroupJob(
            self.version, done.job.group, list(members), {}, workdirs, kind="eval", shard_dir=self.shard_dir
        )

    def written(self, group: WrittenGroup) -> dict[str, Any] | None:
        """One of its tasks' shards is written; the eval's metrics row once its last session is in and every
        shard is written. The shard of an eval abandoned meanwhile is removed."""
        if group.step != self.version:
            group.shard.path.unlink(missing_ok=True)
            return None
        self.writing -= 1
        self.shards.append(group.shard.path.name)
        if self.writing or len(self.done) < len(self.tasks) * self.cfg.eval.samples:
            return None
        row = self.row()
        self.version = None
        return row

    def row(self) -> dict[str, Any]:
        samples = [sample_of(o) for o in self.done]
        k = self.cfg.eval.samples
        table_dir = self.shard_dir.parent / "eval"
        table_dir.mkdir(exist_ok=True)
        csv_path, _ = write_task_table(samples, table_dir, f"v{self.version:05d}-tasks")
        return {
            "event": "eval",
            "version": self.version,  # weights after this many steps
            "weight_versions": sorted(self.versions_seen),  # what the calls were served with
            "temperature": self.cfg.eval.temperature,
            **summarize(samples, k),
            "per_family": summarize_by_family(samples, k),
            "shards": sorted(self.shards),
            "task_table": str(csv_path.relative_to(self.shard_dir.parent)),  # and .json beside it
        }


def write_task_table(samples: list[Sample], out: Path, stem: str) -> tuple[Path, Path]:
    """The per-task table as CSV and JSON beside each other (out/stem.csv, out/stem.json)."""
    rows = task_table(samples)
    csv_path, json_path = out / f"{stem}.csv", out / f"{stem}.json"
    with csv_path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["task_id"])
        w.writeheader()
        w.writerows(rows)
    json_path.write_text(json.dumps(rows, indent=1))
    return csv_path, json_path
