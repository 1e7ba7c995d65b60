"""Training logprobs of the distribution each token was sampled from (`rl.logprob_distribution`).

Every policy token carries the sampling parameters of the call that generated it (a tree holds calls
of different temperatures), so the temperature is per token along the packed sequence:
- tempered (default): log softmax(logits / T)[token]; top-k/top-p/min-p truncation ignored, as most
  RL frameworks do and as SGLang's `output_token_logprobs` are.
- truncated: the same probabilities renormalised over the kept set (the top-k most likely tokens,
  within the top-p nucleus, at least min-p times the most likely token's probability). The kept set
  is recomputed under the current weights and taken as a constant (a mask); the target always counts
  as kept, so a token the updated policy would no longer keep stays finite.
A greedy call (temperature below 1e-6) counts as temperature 1 and top-k 1, as SGLang normalises it.
The embedded engine computes the same two definitions (gyre/engine/sampling.py); tests compare them.

Shapes: N tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gyre.traj.tree import CONTEXT, GREEDY_EPS, TrajectoryTree

_NEUTRAL = (1.0, 1.0, -1.0, 0.0)  # temperature, top_p, top_k, min_p of context tokens


@dataclass
class TokenSampling:
    """Per-token sampling parameters of the generating call, greedy already normalised."""

    temperature: torch.Tensor  # [N] float32, > 0
    top_p: torch.Tensor  # [N] float32
    top_k: torch.Tensor  # [N] long, -1 = no limit
    min_p: torch.Tensor  # [N] float32
    truncated: bool = False  # rl.logprob_distribution=truncated: renormalise over the kept set

    @classmethod
    def from_table(cls, table: np.ndarray, truncated: bool = False) -> TokenSampling:
        """table [N, 4] (temperature, top_p, top_k, min_p), as `tree_sampling_table` gives."""
        t = torch.from_numpy(np.ascontiguousarray(table, dtype=np.float64))
        return cls(t[:, 0].float(), t[:, 1].float(), t[:, 2].long(), t[:, 3].float(), truncated)

    def take(self, index: torch.Tensor) -> TokenSampling:
        """The rows `index` (a segment's targets in split-tree training)."""
        return TokenSampling(
            self.temperature[index], self.top_p[index], self.top_k[index], self.min_p[index], self.truncated
        )

    def to(self, device: torch.device | str) -> TokenSampling:
        return TokenSampling(
            self.temperature.to(device), self.top_p.to(device), self.top_k.to(device), self.min_p.to(device),
            self.truncated,
        )  # fmt: skip


def tree_sampling_table(tree: TrajectoryTree) -> np.ndarray:
    """[N, 4] float64 (temperature, top_p, top_k, min_p) per tree token, from its generating call; context
    tokens get the neutral row. A greedy call becomes temperature 1, top-k 1."""
    table = np.tile(np.asarray(_NEUTRAL, dtype=np.float64), (tree.n_tokens, 1))
    if not tree.calls:
        return table
    ids = np.asarray([c.call_id for c in tree.calls], dtype=np.int64)
    rows = np.asarray(
        [(1.0, c.top_p, 1.0, c.min_p) if c.temperature < GREEDY_EPS else (c.temperature, c.top_p, c.top_k, c.min_p)
         for c in tree.calls],
        dtype=np.float64,
    )  # fmt: skip
    order = np.argsort(ids)
    generated = np.flatnonzero(tree.call_id != CONTEXT)
    pos = np.minimum(np.searchsorted(ids[order], tree.call_id[generated]), len(ids) - 1)
    where = order[pos]
    if np.any(ids[where] != tree.call_id[generated]):
        raise ValueError(f"tree {tree.rollout_id}: a token's call_id is not among its calls")
    table[generated] = rows[where]
    return table


def kept_mask(logprobs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logprobs [R, V] of tempered distributions -> [R, V] bool, the tokens top-k/top-p/min-p keep (vocab order)."""
    probs, order = logprobs.exp().sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    limit = torch.where(top_k > 0, top_k, probs.shape[-1])
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each sorted token
    keep = (rank < limit[:, None]) & ((before < top_p[:, None]) | (rank == 0))
    keep &= probs >= min_p[:, None] * probs[:, :1]
    return torch.zeros_like(keep).scatter_(1, order, keep)


def sampled_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, sampling: TokenSampling) -> torch.Tensor:
    """logits [N, V] (the row that predicts each target), targets [N] -> [N] fp32 logprobs of the targets under
    the distribution their calls sampled from (module docstring). Differentiable in logits."""
    scaled = logits.float() / sampling.temperature[:, None]
    logp = scaled.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    if not sampling.truncated:
        return logp
    rows = torch.nonzero((sampling.top_p < 1) | (sampling.top_k > 0) | (sampling.min_p > 0)).squeeze(-1)
    if rows.numel() == 0:
        return logp
    z, tgt = scaled[rows], targets[rows]
    with torch.no_grad():
        keep = kept_mask(torch.log_softmax(z, dim=-1), sampling.top_p[rows], sampling.top_k[rows], sampling.min_p[rows])
        keep.scatter_(1, tgt[:, None], True)
    kept_lse = torch.logsumexp(z.masked_fill(~keep, float("-inf")), dim=-1)
    return logp.index_put((rows,), z.gather(-1, tgt[:, None]).squeeze(-1) - kept_lse)
