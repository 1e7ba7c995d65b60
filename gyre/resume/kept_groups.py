"""The completed groups of an interrupted step, kept by the resumed run instead of run again.

A group's shard is written (atomically) the moment its last rollout is graded, before the step trains. When a run
stops in the middle of step k (a crash, SIGKILL, a node lost), the checkpoint holds the completed steps 0..k-1 and
weight version W; a shard of step k that is complete (it reads back and its checksums hold), records how its
group's rollouts ended (gyre.pipeline.outcome_record) and whose every call was served by version W is exactly what
the resumed run would produce again, at the cost of running it. So the resumed run keeps it: the shard stays, the
group's rollouts are not run again, and the step trains it with the groups it does run. A shard served by another
version (a newer one, whose weights the checkpoint lost) is moved aside as before.

`find_kept_groups` decides (prepare_resume calls it); `restore_groups` turns the kept groups back into what the
loops hold for a finished group (its rollouts, their calls from calls.jsonl, its GroupShard), for the controller's
step book (gyre.sched.controller.steps), for every scheduler.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.harness.runner import RolloutOutcome
from gyre.pipeline import FinishedRollout, GroupShard
from gyre.proxy.call_log import CallRecord
from gyre.store.reader import read_shard
from gyre.store.schema import ShardError
from gyre.tasks.grading import Grade
from gyre.tasks.task import Task

GROUP_SHARD = re.compile(r"^step(\d+)-group(\d+)\.h5$")
CALL_LOG = "calls.jsonl"


@dataclass
class KeptGroup:
    step: int
    group: int
    shard: Path
    outcomes: list[dict[str, Any]] = field(default_factory=list)  # outcome_record of each rollout, stored or not

    @property
    def rollout_ids(self) -> list[str]:
        return [o["rollout_id"] for o in self.outcomes]


def find_kept_groups(output_dir: Path, step: int, weight_version: int) -> dict[int, KeptGroup]:
    """The groups of `step` whose shards are complete and were served by `weight_version` alone, by group."""
    kept: dict[int, KeptGroup] = {}
    for path in sorted((output_dir / "shards").glob(f"step{step:05d}-group*.h5")):
        match = GROUP_SHARD.match(path.name)
        if match is None or int(match[1]) != step:
            continue
        try:
            shard = read_shard(path)
        except ShardError:
            continue  # not a whole shard: moved aside, its group runs again
        outcomes = json.loads(str(shard.attrs.get("producer", "{}"))).get("outcomes")
        versions = {v for joined in shard.rollouts["weight_versions"] for v in str(joined).split(",") if v}
        if outcomes and versions <= {str(weight_version)}:
            kept[int(match[2])] = KeptGroup(step, int(match[2]), path, outcomes)
    return kept


@dataclass
class RestoredGroup:
    members: list[FinishedRollout]  # as the group finished: its rollouts' outcomes and calls
    shard: GroupShard


def restore_groups(kept: dict[int, KeptGroup], tasks: Sequence[Task], output_dir: Path) -> dict[int, RestoredGroup]:
    """The kept groups as finished groups; `tasks`: the step's tasks, by group (TaskPool.for_step)."""
    calls = kept_calls(output_dir / CALL_LOG, {rid for k in kept.values() for rid in k.rollout_ids})
    out = {}
    for g, k in sorted(kept.items()):
        members = [FinishedRollout(g, _outcome(o, tasks[g]), calls.get(o["rollout_id"], [])) for o in k.outcomes]
        out[g] = RestoredGroup(sorted(members, key=lambda m: m.outcome.rollout_id), group_shard(k, len(members)))
    return out


def kept_calls(call_log: Path, rollout_ids: set[str]) -> dict[str, list[CallRecord]]:
    """The recorded calls of these rollouts (recovery kept their lines in calls.jsonl)."""
    by_rollout: dict[str, list[CallRecord]] = {}
    if not rollout_ids or not call_log.exists():
        return by_rollout
    with call_log.open() as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("rollout_id") in rollout_ids:
                by_rollout.setdefault(row["rollout_id"], []).append(CallRecord.from_json(row))
    return by_rollout


def group_shard(kept: KeptGroup, n_rollouts: int) -> GroupShard:
    """A kept shard's record, as write_group_shard returned it when the group finished."""
    shard = read_shard(kept.shard)
    r, c = shard.rollouts, shard.calls
    stored = {str(rid) for rid in r["rollout_id"]}
    rows = zip(r["rollout_id"], r["exclusion_reason"], r["excluded"], strict=True)
    excluded = {str(rid): str(why) for rid, why, ex in rows if ex}
    excluded |= {rid: "call log rejected" for rid in kept.rollout_ids if rid not in stored}
    return GroupShard(
        kept.shard,
        kept.step,
        kept.group,
        n_rollouts,
        n_trained=int((~r["excluded"]).sum()),
        tokens=int(r["n_tokens"].sum()),
        path_tokens=int((c["n_input"].astype("int64") + c["n_output"]).sum()),
        policy_tokens=int(shard.tokens["policy"].sum()),
        excluded=excluded,
    )


def _outcome(record: dict[str, Any], task: Task) -> RolloutOutcome:
    grade = Grade(**{k: v for k, v in record["grade"].items() if k != "success"})
    return RolloutOutcome(
        record["rollout_id"], task, grade, record["wall_s"], record["turns"], record["stop_reason"],
        record["timed_out"], errors=list(record.get("errors", [])),
    )  # fmt: skip
