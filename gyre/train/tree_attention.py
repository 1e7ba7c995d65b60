"""Exact attention over a packed token forest without an N x N mask: each token sees its ancestors and itself.

Tokens must be in depth-first preorder (gyre/train/tree_pack.py packs them so). Then a token's
subtree is the index range [i, subtree_end[i]), so "key j is an ancestor-or-self of query q" is
`j <= q < subtree_end[j]`, and for a block of consecutive queries [qa, qb) every ancestor of a block
token that lies before qa is an ancestor of qa. A block's keys are therefore the root path of qa
plus the block itself: at most depth(qa) + block tokens (blocks are cut where the order jumps back up
to a much shallower token, so few of those keys go unused), gathered as a few contiguous ranges of the
shared K/V (heavy-child-first order keeps the root path to O(log N) ranges). Every token's K/V is
computed once and reused by all descendant blocks.

Memory: forward and backward go block by block. Autograd keeps only q, k, v (linear in N); the
per-block key gather and the [block, keys] mask are transient (about `mask_budget` elements at
most), and the scores stay inside torch's fused attention kernel. On CPU the backward pass uses
torch's flash-attention backward with the saved logsumexp; elsewhere it recomputes each block's
attention (about one extra attention forward). Compute is exact attention:
sum over tokens of (depth + 1), i.e. O(N * path length) for long paths, with no N x N tensor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

Ranges = tuple[tuple[int, int], ...]  # half-open [start, end) index ranges, sorted, disjoint
# Given keys/values of the tokens before query_start, [Hkv, query_start, D] each, and where their
# gradients are added (same shapes; None when no gradient is wanted).
Prefix = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None

DEFAULT_MASK_BUDGET = 1 << 21  # elements of one block's [queries, keys] mask
MIN_BLOCK, MAX_BLOCK = 16, 512


@dataclass
class TreeAttentionPlan:
    """Everything the attention kernel needs about one packed forest (batch size 1).

    Tokens [0, query_start) are keys only: their keys and values are given, not computed (the cached
    ancestors of one segment of a split tree, gyre/train/split_tree.py); queries are the rest.
    """

    positions: torch.Tensor  # [N - query_start] long: each query token's depth along its path, its RoPE position
    subtree_end: torch.Tensor  # [N] long: token i's subtree is [i, subtree_end[i])
    blocks: list[tuple[int, int, Ranges]]  # (qa, qb, key ranges) covering [query_start, N) in order
    query_start: int = 0
    prefix: Any = None  # the key-only tokens' per-layer keys/values (split_tree.SegmentKV); None when query_start=0
    rope_table: torch.Tensor | None = None  # RoPE rows by position when positions can exceed the query count

    @property
    def n_tokens(self) -> int:
        """Query tokens."""
        return int(self.positions.shape[0])

    def to(self, device: torch.device | str) -> TreeAttentionPlan:
        return dataclasses.replace(self, positions=self.positions.to(device), subtree_end=self.subtree_end.to(device))

    def max_keys(self) -> int:
        return max(sum(b - a for a, b in ranges) for _, _, ranges in self.blocks)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if a >= b:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def plan_from_parents(
    parent: np.ndarray, block_size: int | None = None, mask_budget: int = DEFAULT_MASK_BUDGET, query_start: int = 0
) -> TreeAttentionPlan:
    """parent [N] (index of each token's parent, -1 at a root), tokens in depth-first preorder.

    With query_start > 0, tokens before it are keys only (see TreeAttentionPlan)."""
    parent = np.asarray(parent, dtype=np.int64)
    n = int(parent.shape[0])
    if n <= query_start:
        raise ValueError("cannot plan attention for an empty tree batch")
    idx = np.arange(n)
    if np.any(parent >= idx) or np.any(parent < -1):
        raise ValueError("every parent must come before its child (and roots have parent -1)")
    n_children = np.bincount(parent[parent >= 0], minlength=n)
    # a chain segment continues while the previous token is the parent and has no other child
    cont = np.zeros(n, dtype=bool)
    cont[1:] = (parent[1:] == idx[:-1]) & (n_children[:-1] == 1)
    seg_start = np.flatnonzero(~cont)
    seg_end = np.append(seg_start[1:], n)
    seg_of = np.cumsum(~cont) - 1
    first_parent = parent[seg_start]
    seg_parent = np.where(first_parent >= 0, seg_of[np.maximum(first_parent, 0)], -1)

    # Walk the segments with the current root path on a stack; a segment whose parent is not on it
    # means the order is not depth-first. `merged` holds the stack's token ranges, merged.
    n_seg = len(seg_start)
    anc: list[Ranges] = [()] * n_seg
    stack: list[int] = []
    undo: list[tuple[int, tuple[int, int] | None]] = []  # per stack entry: len(merged) before, old last
    merged: list[tuple[int, int]] = []
    for s in range(n_seg):
        p = int(seg_parent[s])
        while stack and stack[-1] != p:
            stack.pop()
            size, last = undo.pop()
            del merged[size:]
            if last is not None:
                merged[-1] = last
        if p >= 0 and not stack:
            raise ValueError(
                f"token {seg_start[s]} does not follow its parent's subtree in depth-first order; "
                "pack trees with gyre.train.tree_pack.pack_trees"
            )
        anc[s] = tuple(merged)
        a, b = int(seg_start[s]), int(seg_end[s])
        if merged and merged[-1][1] == a:
            undo.append((len(merged), merged[-1]))
            merged[-1] = (merged[-1][0], b)
        else:
            undo.append((len(merged), None))
            merged.append((a, b))
        stack.append(s)

    sub_end = seg_end.copy()
    for s in range(n_seg - 1, -1, -1):
        if seg_parent[s] >= 0:
            sub_end[seg_parent[s]] = max(sub_end[seg_parent[s]], sub_end[s])
    # depth = offset in segment + depth of the segment's first token; segments come parents-first
    seg_depth = np.zeros(n_seg, dtype=np.int64)
    for s in range(n_seg):
        if seg_parent[s] >= 0:
            seg_depth[s] = seg_depth[seg_parent[s]] + (seg_end[seg_parent[s]] - seg_start[seg_parent[s]])
    depth = seg_depth[seg_of] + (idx - seg_start[seg_of])

    if block_size is None:
        block_size = int(np.clip(mask_budget // (int(depth.max()) + 1), MIN_BLOCK, MAX_BLOCK))
    # A block also starts where depth-first order jumps back up by more than half the depth (a new
    # tree, or a branch off a shallow point after a deep one): queries there would not use the keys
    # of the deep root path the block is charged for.
    jumps = seg_start[1:][depth[seg_start[1:]] * 2 < depth[seg_start[1:] - 1] + 1]
    blocks = []
    qa = query_start
    while qa < n:
        next_jump = jumps[np.searchsorted(jumps, qa, side="right")] if len(jumps) and jumps[-1] > qa else n
        qb = min(qa + block_size, int(next_jump))
        s = int(seg_of[qa])
        blocks.append((qa, qb, tuple(_merge([*anc[s], (int(seg_start[s]), qb)]))))
        qa = qb
    return TreeAttentionPlan(
        torch.from_numpy(depth[query_start:]), torch.from_numpy(sub_end[seg_of]), blocks, query_start=query_start
    )


def _pieces(ranges: Ranges, split: int) -> list[tuple[int, int]]:
    """The ranges cut at `split` (the first computed token: keys before it are given, see TreeAttentionPlan)."""
    out = []
    for a, b in ranges:
        if a < split < b:
            out += [(a, split), (split, b)]
        else:
            out.append((a, b))
    return out


def _block_inputs(
    k: torch.Tensor, v: torch.Tensor, plan: TreeAttentionPlan, qa: int, qb: int, ranges: Ranges, prefix: Prefix
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gathered keys/values [1, Hkv, K, D] and the [qb - qa, K] mask (True = attend) of one block.

    k, v [Hkv, N - query_start, D] hold the computed tokens; keys before query_start come from `prefix`."""
    d = plan.query_start
    parts = _pieces(ranges, d)
    if prefix is None:
        kb = torch.cat([k[:, a:b] for a, b in parts], dim=1)[None]
        vb = torch.cat([v[:, a:b] for a, b in parts], dim=1)[None]
    else:
        kp, vp = prefix[0], prefix[1]
        kb = torch.cat([kp[:, a:b] if b <= d else k[:, a - d : b - d] for a, b in parts], dim=1)[None]
        vb = torch.cat([vp[:, a:b] if b <= d else v[:, a - d : b - d] for a, b in parts], dim=1)[None]
    key_idx = torch.cat([torch.arange(a, b, device=k.device) for a, b in ranges])
    q_idx = torch.arange(qa, qb, device=k.device)[:, None]
    mask = (key_idx[None] <= q_idx) & (q_idx < plan.subtree_end[key_idx][None])
    return kb, vb, mask


def _fused_cpu_ops() -> tuple | None:
    """torch's CPU flash-attention forward (returning the logsumexp) and backward, when this torch has them.

    With them the backward pass needs no recomputation; elsewhere (CUDA, other builds) the public
    scaled_dot_product_attention is used and each block is recomputed in the backward pass.
    """
    try:
        aten = torch.ops.aten
        return (
            aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_flash_attention_for_cpu_backward,
        )
    except (AttributeError, RuntimeError):
        return None


_CPU_FLASH = _fused_cpu_ops()


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


class _TreeAttention(torch.autograd.Function):
    """q [1, H, Nq, D], k/v [1, Hkv, N, D] (queries are tokens [N - Nq, N)); block by block, saving only
    q, k, v, out (and the logsumexp). k/v hold the query tokens' own keys/values; those of the tokens before
    query_start are in `prefix`, whose gradients the backward pass adds to its sinks in place."""

    @staticmethod
    def forward(ctx, q, k, v, plan, scale, prefix):  # noqa: ANN001, ANN205 - autograd.Function protocol
        fused = _CPU_FLASH is not None and q.device.type == "cpu"
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:3]) if fused else None
        off = plan.query_start
        for qa, qb, ranges in plan.blocks:
            kb, vb, mask = _block_inputs(k[0], v[0], plan, qa, qb, ranges, prefix)
            if fused:
                o, lse_b = _CPU_FLASH[0](
                    q[:, :, qa - off : qb - off], kb, vb, 0.0, False, attn_mask=_additive(mask, q.dtype), scale=scale
                )
                out[:, :, qa - off : qb - off], lse[:, :, qa - off : qb - off] = o, lse_b
            else:
                out[:, :, qa - off : qb - off] = _sdpa(q[:, :, qa - off : qb - off], kb, vb, mask, scale)
        ctx.save_for_backward(q, k, v, out, *([lse] if fused else []))
        ctx.plan, ctx.scale, ctx.fused, ctx.prefix = plan, scale, fused, prefix
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205 - autograd.Function protocol
        q, k, v, out, *lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        off, prefix = plan.query_start, ctx.prefix
        sink_k, sink_v = (prefix[2], prefix[3]) if prefix is not None else (None, None)
        for qa, qb, ranges in plan.blocks:
            kb, vb, mask = _block_inputs(k[0], v[0], plan, qa, qb, ranges, prefix)
            qs = slice(qa - off, qb - off)
            if ctx.fused:
                gq, gk, gv = _CPU_FLASH[1](
                    grad_out[:, :, qs], q[:, :, qs], kb, vb, out[:, :, qs], lse[0][:, :, qs],
                    0.0, False, attn_mask=_additive(mask, q.dtype), scale=scale,
                )  # fmt: skip
            else:
                with torch.enable_grad():
                    qb_, kb, vb = (t.detach().requires_grad_() for t in (q[:, :, qs], kb, vb))
                    o = _sdpa(qb_, kb, vb, mask, scale)
                    gq, gk, gv = torch.autograd.grad(o, (qb_, kb, vb), grad_out[:, :, qs])
            dq[:, :, qs] = gq
            offset = 0
            for a, b in _pieces(ranges, off):
                if b <= off:  # a given key: its gradient goes to the prefix's sink, if it wants one
                    if sink_k is not None:
                        sink_k[:, a:b] += gk[0, :, offset : offset + b - a]
                        sink_v[:, a:b] += gv[0, :, offset : offset + b - a]
                else:
                    dk[:, :, a - off : b - off] += gk[:, :, offset : offset + b - a]
                    dv[:, :, a - off : b - off] += gv[:, :, offset : offset + b - a]
                offset += b - a
        return dq, dk, dv, None, None, None


def tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TreeAttentionPlan, scale: float, prefix: Prefix = None
) -> torch.Tensor:
    """q [H, N, D], k and v [Hkv, N, D] (H a multiple of Hkv; query head h uses kv head h // (H/Hkv))
    -> [H, N, D]: softmax(q k^T * scale) v with each query restricted to its ancestors and itself.
    With plan.query_start > 0, q, k and v hold only the query tokens [query_start, N), and `prefix` the
    keys/values of the tokens before them (see Prefix)."""
    if q.shape[1] != plan.n_tokens or k.shape[1] != plan.n_tokens:
        raise ValueError(f"plan covers {plan.n_tokens} query tokens, q/k have {q.shape[1]}/{k.shape[1]}")
    if (prefix is None) != (plan.query_start == 0) or (prefix is not None and prefix[0].shape[1] != plan.query_start):
        raise ValueError(
            f"plan has {plan.query_start} given tokens before its queries; pass their keys/values as prefix"
        )
    if q.shape[0] % k.shape[0]:
        raise ValueError(f"{q.shape[0]} query heads are not a multiple of {k.shape[0]} key/value heads")
    return _TreeAttention.apply(q[None].contiguous(), k[None].contiguous(), v[None].contiguous(), plan, scale, prefix)[
        0
    ]


def dense_tree_mask(parent: np.ndarray) -> torch.Tensor:
    """[N, N] bool, True = attend (ancestors and self). O(N^2): for tests and small references only."""
    parent = np.asarray(parent, dtype=np.int64)
    n = len(parent)
    allowed = torch.eye(n, dtype=torch.bool)
    for i in range(n):
        if parent[i] >= 0:
            allowed[i] |= allowed[parent[i]]
    return allowed
