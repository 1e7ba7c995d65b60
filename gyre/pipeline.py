"""The trajectory side of a step: finished rollouts -> trees -> scores -> bounded samples -> shards -> micro-batches.

A group is the unit: its advantages need all its members, so a group's shard is written as soon as
its last rollout is graded, and training (colocate, async or elastic) streams micro-batches from the
shards. Nothing here knows which cell trains them.

Exclusions, never silent: a failed evaluation (score None), a call log the tree builder rejects
(TreeError) and a rollout with no trainable token are stored with their reason and zero weight.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gyre.config.schema import LogprobDistribution, MismatchConfig, MismatchProximal, RunConfig
from gyre.harness.runner import RolloutOutcome
from gyre.proxy.call_log import CallRecord
from gyre.store.reader import ShardRollout
from gyre.store.schema import RolloutMeta
from gyre.store.writer import ShardWriter
from gyre.train.gspo import group_advantages
from gyre.train.mismatch import behaviour_ratio, corrected_gspo_loss, correction_weights, mismatch_metrics
from gyre.train.tree_pack import TreeMicroBatch, pack_trees
from gyre.traj.build import build_tree
from gyre.traj.sampling import sample_tree
from gyre.traj.tree import TreeError


@dataclass
class FinishedRollout:
    group: int
    outcome: RolloutOutcome
    calls: list[CallRecord]


@dataclass
class GroupShard:
    path: Path
    step: int
    group: int
    n_rollouts: int
    n_trained: int
    tokens: int  # tree tokens stored (shared prefixes once)
    path_tokens: int  # tokens if every stored call's context + output were its own sequence (sum over calls)
    policy_tokens: int
    excluded: dict[str, str] = field(default_factory=dict)  # rollout id -> reason
    rejected: list[str] = field(default_factory=list)  # rollout ids not stored: their call log made no tree


EVAL_EXCLUSION = "eval rollout: never trained"


def write_group_shard(
    cfg: RunConfig,
    shard_dir: Path,
    step: int,
    group: int,
    rollouts: Sequence[FinishedRollout],
    skipped: Mapping[str, str] | None = None,
    kind: str = "train",
) -> GroupShard:
    """Score one finished group and write it as one shard (atomic: temp file + rename). `skipped`: the
    suite's tasks that could not be loaded (name -> cause), kept in the shard's provenance. kind="eval": one
    eval task's samples after weight version `step` (gyre.sched.controller.evaluation), every rollout excluded from training
    (no reward, no advantage, no loss weight; its score kept), the producer's "kind" says so."""
    scores = [r.outcome.grade.score for r in rollouts]
    rewards = torch.tensor([[math.nan if s is None else s for s in scores]], dtype=torch.float64)
    advantages = group_advantages(rewards)[0].tolist()
    name = f"step{step:05d}-group{group:04d}.h5" if kind == "train" else f"eval-v{step:05d}-task{group:04d}.h5"
    path = shard_dir / name
    result = GroupShard(path, step, group, len(rollouts), 0, 0, 0, 0)
    producer = {"harness": cfg.harness.kind, "sandbox": cfg.sandbox.backend,  # "none" is on record in every shard
                "tasks": task_provenance(cfg, rollouts, skipped), "kind": kind,
                "outcomes": [outcome_record(r.outcome) for r in rollouts]}  # fmt: skip
    with ShardWriter(path, run_id=cfg.output_dir or "gyre", step=step, producer=producer) as w:
        for r, adv in zip(rollouts, advantages, strict=True):
            rid, grade = r.outcome.rollout_id, r.outcome.grade
            reason = "" if grade.score is not None else f"evaluation failed: {grade.reason}"
            if kind == "eval":
                reason = EVAL_EXCLUSION if not reason else f"{EVAL_EXCLUSION}; {reason}"
            try:
                sampled = sample_tree(build_tree(rid, r.calls), k=cfg.rl.max_trajectories_per_rollout)
            except TreeError as e:
                result.excluded[rid] = f"call log rejected: {e}"
                result.rejected.append(rid)
                continue  # no tree to store; the reason is kept in the step's metrics
            if not reason and sampled.n_targets == 0:
                reason = "no trainable policy token"
            if not reason and not math.isfinite(adv):
                reason = "group has no other graded rollout"
            meta = RolloutMeta(
                group_id=f"s{step}-g{group}" if kind == "train" else f"eval-v{step}-t{group}",
                task_id=r.outcome.task.task_id,
                task_family=r.outcome.task.family,
                harness=cfg.harness.kind,
                grade_status=grade.status,
                grade_reason=grade.reason,
                score=grade.score,
                reward=None if reason else grade.score,
                advantage=None if reason else float(adv),
                exclusion_reason=reason,
            )
            w.add(sampled, meta)
            if reason:
                result.excluded[rid] = reason
            else:
                result.n_trained += 1
            result.tokens += sampled.tree.n_tokens
            result.path_tokens += sum(c.n_input + c.n_output for c in sampled.tree.calls)
            result.policy_tokens += sampled.n_targets
    return result


def outcome_record(outcome: RolloutOutcome) -> dict[str, Any]:
    """How a rollout ended (its grade without the per-check detail), as the group's shard keeps it: a resumed run
    restores a completed group from its shard (gyre.resume.kept_groups) without running it again."""
    grade = {k: v for k, v in outcome.grade.__dict__.items() if k != "checks"}
    return {
        "rollout_id": outcome.rollout_id, "grade": grade, "wall_s": outcome.wall_s, "turns": outcome.turns,
        "stop_reason": outcome.stop_reason, "timed_out": outcome.timed_out, "errors": outcome.errors[:3],
    }  # fmt: skip


def task_provenance(
    cfg: RunConfig, rollouts: Sequence[FinishedRollout], skipped: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Where the group's task came from: the source, its path and split, each instance's own path, and (when
    there are any) the suite's tasks that were skipped, with their causes."""
    tasks = {r.outcome.task.task_id: r.outcome.task for r in rollouts}
    out = {
        "source": cfg.tasks.source, "path": cfg.tasks.path, "split": cfg.tasks.split,
        "instances": {tid: t.source_path or t.family for tid, t in sorted(tasks.items())},
    }  # fmt: skip
    if skipped:
        out["skipped"] = dict(sorted(skipped.items()))
    return out


def with_signal(rollouts: Iterable[ShardRollout]) -> list[ShardRollout]:
    """The rollouts with a non-zero advantage: the only ones whose loss has a gradient."""
    return [r for r in rollouts if r.meta.advantage]


def loss_rollouts(rollouts: Sequence[ShardRollout], loss_norm: str) -> int:
    """|R|, what the step's summed per-rollout losses are divided by, from the step's non-excluded rollouts.

    all_rollouts: all of them (zero-advantage ones count, as in the GSPO paper and TRL); with_signal: only
    those with a non-zero advantage. Excluded rollouts (failed evaluations, ...) are never counted.
    """
    if loss_norm == "all_rollouts":
        return len(rollouts)
    if loss_norm == "with_signal":
        return len(with_signal(rollouts))
    raise ValueError(f"rl.loss_norm={loss_norm!r}: choose all_rollouts or with_signal")


@dataclass
class RLMicroBatch:
    """A tree micro-batch plus what GSPO needs per tree: its advantage and its share of the step."""

    batch: TreeMicroBatch
    advantages: torch.Tensor  # [n_trees] float32, by batch.tree_index
    rollout_scale: float  # 1 / rollouts the step normalises over
    proximal: torch.Tensor | None = None  # [n_tokens] the trainer's logprobs before the update (proximal=trainer)

    @property
    def n_tokens(self) -> int:
        return self.batch.n_tokens


def rl_micro_batches(
    rollouts: Sequence[ShardRollout],
    token_budget: int,
    max_len: int,
    step_rollouts: int,
    logprob_distribution: LogprobDistribution = LogprobDistribution.tempered,
) -> list[RLMicroBatch]:
    """Pack whole trees by token budget; each rollout's loss is scaled by 1/step_rollouts. Training logprobs
    describe `logprob_distribution` (rl.logprob_distribution), as the behaviour logprobs the proxy recorded."""
    if not rollouts:
        return []
    trees = [r.tree for r in rollouts]
    adv = {r.rollout_id: float(r.meta.advantage) for r in rollouts}
    batches = pack_trees(trees, token_budget, [r.loss_weight for r in rollouts], max_len=max_len)
    truncated = logprob_distribution is LogprobDistribution.truncated
    for b in batches:
        b.sampling = replace(b.sampling, truncated=truncated)
    return [
        RLMicroBatch(b, torch.tensor([adv[rid] for rid in b.rollout_ids], dtype=torch.float32), 1.0 / step_rollouts)
        for b in batches
    ]


def rollout_log_ratios(logp: torch.Tensor, mb: RLMicroBatch) -> torch.Tensor:
    """[n_trees]: each rollout's sequence-level log ratio, the loss-weighted mean of its tokens' log ratios.

    A sampled tree's loss weights sum to 1, so this is the mean over its distinct policy targets
    (shared targets counted once)."""
    b = mb.batch
    w = b.loss_weight.to(logp.device)
    per_token = (logp - b.old_logprobs.to(logp.device)) * w
    n_trees = len(b.rollout_ids)
    num = torch.zeros(n_trees, dtype=logp.dtype, device=logp.device).index_add(
        0, b.tree_index.to(logp.device), per_token
    )
    den = torch.zeros(n_trees, dtype=logp.dtype, device=logp.device).index_add(0, b.tree_index.to(logp.device), w)
    return num / den.clamp(min=1e-12)


def tree_gspo_loss_fn(eps_low: float, eps_high: float, mismatch: MismatchConfig | None = None) -> TreeGSPOLoss:
    """GSPO on tree micro-batches: clipped sequence-level ratio per rollout, rollouts weighted equally, with
    rl.mismatch's proximal policy and behaviour correction (gyre/train/mismatch.py)."""
    return TreeGSPOLoss(eps_low, eps_high, mismatch or MismatchConfig())


@dataclass(frozen=True)
class TreeGSPOLoss:
    """The trainer's loss callable. `needs_proximal`: the trainer sets each micro-batch's `proximal` (its own
    logprobs under the weights before the update, no gradient) before the forward with gradient."""

    eps_low: float
    eps_high: float
    mismatch: MismatchConfig

    @property
    def needs_proximal(self) -> bool:
        return self.mismatch.proximal == MismatchProximal.trainer

    def __call__(self, logp: torch.Tensor, mb: RLMicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        b, m, dev = mb.batch, self.mismatch, logp.device
        weight, index, n = b.loss_weight.to(dev), b.tree_index.to(dev), len(b.rollout_ids)
        behaviour = b.old_logprobs.to(dev)
        if self.needs_proximal and mb.proximal is None:
            raise ValueError("rl.mismatch.proximal=trainer: the micro-batch has no proximal logprobs; train it "
                             "through the trainer's forward_backward, which computes them")  # fmt: skip
        proximal = mb.proximal.to(dev) if self.needs_proximal else behaviour
        ratio = behaviour_ratio(proximal, behaviour, weight, index, n, m.level)
        corr = correction_weights(ratio, m.correction, m.cap, m.low, m.high)
        adv = mb.advantages.to(dev)
        per_rollout, seq_ratio = corrected_gspo_loss(logp, proximal, weight, index, adv, corr, self.eps_low,
                                                     self.eps_high)  # fmt: skip
        loss = per_rollout.sum() * mb.rollout_scale
        clipped = seq_ratio.clamp(1.0 - self.eps_low, 1.0 + self.eps_high)
        trainer = proximal if self.needs_proximal else logp.detach()  # proximal=engine: this forward's own
        return loss, {
            "loss": float(loss.detach()),
            "ratio_mean": float(seq_ratio.mean()),
            "clip_frac": float(((seq_ratio * adv) > (clipped * adv)).float().mean()),
            **mismatch_metrics(trainer, behaviour, weight, index, n, ratio, corr, m.correction, m.cap),
        }


def expanded_tokens(rollouts: Sequence[ShardRollout]) -> int:
    """Tokens training would process if each chosen path were a separate sequence (for dedup metrics)."""
    total = 0
    for r in rollouts:
        for leaf in _chosen_leaves(r):
            total += int(r.tree.depth[leaf]) + 1
    return total


def _chosen_leaves(r: ShardRollout) -> np.ndarray:
    return r.tree.leaves()
