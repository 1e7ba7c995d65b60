"""Scored rollouts + their paths -> padded GSPO micro-batches within a token budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyre.train.gspo import group_advantages, gspo_loss, rollout_sequence_weights
from gyre.traj.paths import Path


@dataclass
class ScoredRollout:
    rollout_id: str
    group: int
    reward: float | None  # None: the evaluation failed; excluded from training
    paths: list[Path]


@dataclass
class MicroBatch:
    """B right-padded paths of T tokens; target-aligned tensors have T-1 columns."""

    tokens: torch.Tensor  # [B, T] long
    policy_mask: torch.Tensor  # [B, T-1] 1 where tokens[:, 1:] is a trained policy token
    old_logprobs: torch.Tensor  # [B, T-1] behaviour logprobs of tokens[:, 1:]
    advantages: torch.Tensor  # [B]
    seq_weight: torch.Tensor  # [B], sums to 1 over all micro-batches of a step

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.numel())


def rollout_advantages(rollouts: list[ScoredRollout]) -> dict[str, float]:
    """Group-normalised advantage of each rollout that has a reward (excluded ones are absent)."""
    groups = sorted({r.group for r in rollouts})
    size = max(sum(1 for r in rollouts if r.group == g) for g in groups)
    rewards = torch.full((len(groups), size), float("nan"), dtype=torch.float64)
    slots: dict[str, tuple[int, int]] = {}
    for gi, g in enumerate(groups):
        members = [r for r in rollouts if r.group == g]
        for j, r in enumerate(members):
            slots[r.rollout_id] = (gi, j)
            if r.reward is not None:
                rewards[gi, j] = r.reward
    adv = group_advantages(rewards)
    return {rid: float(adv[gi, j]) for rid, (gi, j) in slots.items() if not torch.isnan(adv[gi, j])}


def build_micro_batches(
    rollouts: list[ScoredRollout], token_budget: int, pad_id: int, max_len: int | None = None
) -> list[MicroBatch]:
    """Paths of rollouts with a non-zero advantage, packed longest-first into padded micro-batches."""
    adv = rollout_advantages(rollouts)
    items: list[tuple[Path, float, int]] = []
    for idx, r in enumerate(rollouts):
        a = adv.get(r.rollout_id)
        if a is None or a == 0.0:
            continue
        items += [(p, a, idx) for p in r.paths if p.n_policy_tokens > 0]
    if not items:
        return []
    weights = rollout_sequence_weights(torch.tensor([i for _, _, i in items]))
    order = sorted(range(len(items)), key=lambda k: -len(items[k][0].tokens))
    batches: list[list[int]] = []
    for k in order:
        length = len(items[k][0].tokens)
        if max_len is not None and length > max_len:
            raise ValueError(f"a path of {length} tokens exceeds the trainer's maximum of {max_len}")
        # longest first: a batch's first path sets its padded width
        if batches and (len(batches[-1]) + 1) * len(items[batches[-1][0]][0].tokens) <= token_budget:
            batches[-1].append(k)
        else:
            batches.append([k])
    return [_pad([items[k] for k in b], weights[b], pad_id) for b in batches]


def _pad(items: list[tuple[Path, float, int]], weights: torch.Tensor, pad_id: int) -> MicroBatch:
    t = max(len(p.tokens) for p, _, _ in items)
    b = len(items)
    tokens = torch.full((b, t), pad_id, dtype=torch.long)
    mask = torch.zeros(b, t - 1)
    old = torch.zeros(b, t - 1)
    for i, (p, _, _) in enumerate(items):
        n = len(p.tokens)
        tokens[i, :n] = torch.tensor(p.tokens)
        mask[i, : n - 1] = torch.tensor(p.policy_mask[1:], dtype=torch.float32)
        old[i, : n - 1] = torch.tensor(p.behaviour_logprobs[1:])
    advantages = torch.tensor([a for _, a, _ in items], dtype=torch.float32)
    return MicroBatch(tokens, mask, old, advantages, weights.to(torch.float32))


def gspo_loss_fn(eps_low: float, eps_high: float):  # noqa: ANN201 - returns the trainer's loss callable
    def loss_fn(logp: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        return gspo_loss(logp, mb.old_logprobs, mb.policy_mask, mb.advantages, mb.seq_weight, eps_low, eps_high)

    return loss_fn
