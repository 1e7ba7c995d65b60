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

Given keys (query_start > 0: one segment of a split tree, gyre/train/split_tree.py). The tokens before
query_start are a root path whose keys/values are given, not computed. A query's given ancestors are the
path's first m of them, m shrinking along the segment as depth-first order leaves the path's subtrees, so
the queries fall into a few runs of equal m (plan.prefix_runs). Each run attends to its m given keys in
unmasked tiles of at most PREFIX_KEY_CHUNK keys, read in place (no gather, no mask); the blocks hold the
segment's own keys only, under a [block, segment] mask. The parts are merged by their logsumexp, and the
backward pass takes each part's gradients from the merged output and logsumexp (exact: the softmax's
normalisation is the whole one). Transient memory is then set by the segment, not by the path's depth.
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
    # With query_start > 0: (qa, qb, m), queries [qa, qb) also attend to the given tokens [0, m) (the given
    # tokens are a chain, so a query's given ancestors are its first m); blocks then hold computed keys only.
    prefix_runs: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    prefix: Any = None  # the key-only tokens' per-layer keys/values (split_tree.SegmentKV); None when query_start=0
    rope_table: torch.Tensor | None = None  # RoPE rows from position rope_offset on, when positions exceed the queries
    rope_offset: int = 0

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
    seg = _Segments.from_parents(parent)
    anc = _segment_ancestors(seg)
    sub_end = seg.subtree_ends()
    depth = seg.depths()
    runs = _prefix_runs(parent, sub_end, seg.of, query_start) if query_start else []
    if block_size is None:  # with given keys, a block's mask covers the computed keys only
        deepest = int(depth.max()) + 1 if not query_start else n - query_start
        block_size = int(np.clip(mask_budget // deepest, MIN_BLOCK, MAX_BLOCK))
    return TreeAttentionPlan(
        torch.from_numpy(depth[query_start:]),
        torch.from_numpy(sub_end[seg.of]),
        _blocks(seg, anc, depth, block_size, query_start),
        query_start=query_start,
        prefix_runs=runs,
    )


@dataclasses.dataclass(frozen=True)
class _Segments:
    """A tree batch cut into chain segments: runs of tokens each the only child of the one before."""

    start: np.ndarray  # [S] first token of each segment
    end: np.ndarray  # [S] one past its last token
    of: np.ndarray  # [N] segment of each token
    parent: np.ndarray  # [S] segment holding the first token's parent, -1 at a root

    @classmethod
    def from_parents(cls, parent: np.ndarray) -> _Segments:
        n = int(parent.shape[0])
        idx = np.arange(n)
        n_children = np.bincount(parent[parent >= 0], minlength=n)
        # a chain segment continues while the previous token is the parent and has no other child
        cont = np.zeros(n, dtype=bool)
        cont[1:] = (parent[1:] == idx[:-1]) & (n_children[:-1] == 1)
        start = np.flatnonzero(~cont)
        of = np.cumsum(~cont) - 1
        first_parent = parent[start]
        return cls(start, np.append(start[1:], n), of, np.where(first_parent >= 0, of[np.maximum(first_parent, 0)], -1))

    def subtree_ends(self) -> np.ndarray:
        """[S] one past the last token of each segment's subtree (children come after their parents)."""
        sub_end = self.end.copy()
        for s in range(len(self.start) - 1, -1, -1):
            if self.parent[s] >= 0:
                sub_end[self.parent[s]] = max(sub_end[self.parent[s]], sub_end[s])
        return sub_end

    def depths(self) -> np.ndarray:
        """[N] each token's depth: its offset in its segment + the depth of the segment's first token."""
        seg_depth = np.zeros(len(self.start), dtype=np.int64)
        for s in range(len(self.start)):
            if (p := self.parent[s]) >= 0:
                seg_depth[s] = seg_depth[p] + (self.end[p] - self.start[p])
        return seg_depth[self.of] + (np.arange(len(self.of)) - self.start[self.of])


def _segment_ancestors(seg: _Segments) -> list[Ranges]:
    """Each segment's ancestors' tokens as merged ranges. Walks the segments with the current root path on a
    stack; a segment whose parent is not on it means the order is not depth-first. `merged` holds the stack's
    token ranges, merged."""
    anc: list[Ranges] = [()] * len(seg.start)
    stack: list[int] = []
    undo: list[tuple[int, tuple[int, int] | None]] = []  # per stack entry: len(merged) before, old last
    merged: list[tuple[int, int]] = []
    for s in range(len(seg.start)):
        p = int(seg.parent[s])
        while stack and stack[-1] != p:
            stack.pop()
            size, last = undo.pop()
            del merged[size:]
            if last is not None:
                merged[-1] = last
        if p >= 0 and not stack:
            raise ValueError(
                f"token {seg.start[s]} does not follow its parent's subtree in depth-first order; "
                "pack trees with gyre.train.tree_pack.pack_trees"
            )
        anc[s] = tuple(merged)
        a, b = int(seg.start[s]), int(seg.end[s])
        if merged and merged[-1][1] == a:
            undo.append((len(merged), merged[-1]))
            merged[-1] = (merged[-1][0], b)
        else:
            undo.append((len(merged), None))
            merged.append((a, b))
        stack.append(s)
    return anc


def _prefix_runs(
    parent: np.ndarray, sub_end: np.ndarray, seg_of: np.ndarray, query_start: int
) -> list[tuple[int, int, int]]:
    """(qa, qb, m): queries [qa, qb) also attend to the given (key-only) tokens [0, m)."""
    if not np.array_equal(parent[:query_start], np.arange(-1, query_start - 1)):
        raise ValueError("the key-only tokens before query_start must be a chain (a root path, by depth)")
    # the given chain's subtree ends shrink with depth: query q's given ancestors are the first m(q)
    given_end = sub_end[seg_of[:query_start]]
    m = np.searchsorted(-given_end, -np.arange(query_start, len(parent)), side="left")
    cut = np.flatnonzero(np.diff(m)) + 1
    starts, ends = np.append(0, cut), np.append(cut, len(m))
    return [(query_start + a, query_start + b, int(m[a])) for a, b in zip(starts, ends, strict=True) if m[a]]


def _blocks(
    seg: _Segments, anc: list[Ranges], depth: np.ndarray, block_size: int, query_start: int
) -> list[tuple[int, int, Ranges]]:
    """Query blocks of at most `block_size` tokens, each with the key ranges its queries may attend to.

    A block also starts where depth-first order jumps back up by more than half the depth (a new tree, or a
    branch off a shallow point after a deep one): queries there would not use the keys of the deep root path
    the block is charged for."""
    n = len(seg.of)
    jumps = seg.start[1:][depth[seg.start[1:]] * 2 < depth[seg.start[1:] - 1] + 1]
    blocks = []
    qa = query_start
    while qa < n:
        next_jump = jumps[np.searchsorted(jumps, qa, side="right")] if len(jumps) and jumps[-1] > qa else n
        qb = min(qa + block_size, int(next_jump))
        s = int(seg.of[qa])
        ranges = _merge([*anc[s], (int(seg.start[s]), qb)])
        ranges = [(max(a, query_start), b) for a, b in ranges if b > query_start]  # given keys: prefix_runs
        blocks.append((qa, qb, tuple(ranges)))
        qa = qb
    return blocks


def _block_inputs(
    k: torch.Tensor, v: torch.Tensor, plan: TreeAttentionPlan, qa: int, qb: int, ranges: Ranges
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gathered keys/values [1, Hkv, K, D] and the [qb - qa, K] mask (True = attend) of one block.

    k, v [Hkv, N - query_start, D] hold the computed tokens (a block's ranges hold computed keys only)."""
    d = plan.query_start
    kb = torch.cat([k[:, a - d : b - d] for a, b in ranges], dim=1)[None]
    vb = torch.cat([v[:, a - d : b - d] for a, b in ranges], dim=1)[None]
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
# Given keys attended by a run of queries are taken in chunks: no per-chunk buffer grows with the path.
PREFIX_KEY_CHUNK = 1 << 14


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics' dtype: fp32 for fp32 and lower precision, the input's own above."""
    return torch.promote_types(dtype, torch.float32)


def _scores(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores [1, H, nq, nk] (-inf where masked) and k, v repeated to the query heads, at least fp32."""
    group, dtype = q.shape[1] // k.shape[1], _acc(q.dtype)
    k, v = (t.to(dtype).repeat_interleave(group, dim=1) for t in (k, v))
    s = (q.to(dtype) @ k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s, k, v


def _partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, fused: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [1, H, nq, D] over some of its keys, k/v [1, Hkv, nk, D] (mask [nq, nk], True = attend,
    or None for all): its output [1, H, nq, D] and logsumexp [1, H, nq] (_acc), to be merged with the rest."""
    if fused:
        attn_mask = None if mask is None else _additive(mask, q.dtype)
        return _CPU_FLASH[0](q, k, v, 0.0, False, attn_mask=attn_mask, scale=scale)
    s, _, v = _scores(q, k, v, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    return (torch.exp(s - lse[..., None]) @ v).to(q.dtype), lse


def _partial_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v through the part of the attention these keys take, given the whole attention's
    output and logsumexp (out, lse over all of the queries' keys): exact, whatever the other keys are."""
    if fused:
        attn_mask = None if mask is None else _additive(mask, q.dtype)
        return _CPU_FLASH[1](grad_out, q, k, v, out, lse, 0.0, False, attn_mask=attn_mask, scale=scale)
    s, kr, vr = _scores(q, k, v, mask, scale)
    p = torch.exp(s - lse[..., None])  # this part's probabilities under the whole softmax
    g = grad_out.to(p.dtype)
    ds = p * (g @ vr.transpose(-1, -2) - (g * out.to(p.dtype)).sum(-1, keepdim=True))
    group = q.shape[1] // k.shape[1]

    def to_kv_heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(1, k.shape[1], group, *t.shape[2:]).sum(2)

    gk = to_kv_heads(ds.transpose(-1, -2) @ q.to(p.dtype)) * scale
    gv = to_kv_heads(p.transpose(-1, -2) @ g)
    return (ds @ kr * scale).to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)


def _prefix_tiles(plan: TreeAttentionPlan, fused: bool) -> list[tuple[int, int, int, int]]:
    """(qa, qb, ka, kb): queries [qa, qb) attend to all given keys [ka, kb); tiles cover plan.prefix_runs."""
    q_step = MAX_BLOCK if not fused else None  # the unfused path holds a [H, queries, keys] score tile
    k_step = DEFAULT_MASK_BUDGET // MAX_BLOCK if not fused else PREFIX_KEY_CHUNK
    tiles = []
    for qa, qb, m in plan.prefix_runs:
        for q0 in range(qa, qb, q_step or qb - qa):
            q1 = min(qb, q0 + (q_step or qb - qa))
            tiles += [(q0, q1, k0, min(m, k0 + k_step)) for k0 in range(0, m, k_step)]
    return tiles


def _merge_into(out: torch.Tensor, lse: torch.Tensor, qs: slice, o: torch.Tensor, lse_o: torch.Tensor) -> None:
    """out, lse over the queries qs := the attention over their keys so far and over the keys giving (o, lse_o)."""
    before = lse[:, :, qs]
    both = torch.logaddexp(before, lse_o)
    old_w, new_w = torch.exp(before - both)[..., None], torch.exp(lse_o - both)[..., None]
    out[:, :, qs] = (out[:, :, qs] * old_w + o * new_w).to(out.dtype)
    lse[:, :, qs] = both


class _TreeAttention(torch.autograd.Function):
    """q [1, H, Nq, D], k/v [1, Hkv, Nq, D] (queries are tokens [N - Nq, N)); block by block, saving only
    q, k, v, out (and the logsumexp). k/v hold the query tokens' own keys/values; those of the tokens before
    query_start are in `prefix`, attended to in unmasked tiles (plan.prefix_runs) merged by their logsumexp,
    and the backward pass adds their gradients to the prefix's sinks in place."""

    @staticmethod
    def forward(ctx, q, k, v, plan, scale, prefix):  # noqa: ANN001, ANN205 - autograd.Function protocol
        fused = _CPU_FLASH is not None and q.device.type == "cpu"
        with_lse = fused or prefix is not None  # given keys are merged in by logsumexp
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:3], dtype=_acc(q.dtype)) if with_lse else None
        off = plan.query_start
        for qa, qb, ranges in plan.blocks:
            kb, vb, mask = _block_inputs(k[0], v[0], plan, qa, qb, ranges)
            qs = slice(qa - off, qb - off)
            if with_lse:
                out[:, :, qs], lse[:, :, qs] = _partial_attention(q[:, :, qs], kb, vb, mask, scale, fused)
            else:
                out[:, :, qs] = _sdpa(q[:, :, qs], kb, vb, mask, scale)
        if prefix is not None:  # every query attends to itself: lse is finite before the given keys come in
            for qa, qb, ka, kb in _prefix_tiles(plan, fused):
                qs = slice(qa - off, qb - off)
                kp, vp = prefix[0][None, :, ka:kb], prefix[1][None, :, ka:kb]
                _merge_into(out, lse, qs, *_partial_attention(q[:, :, qs], kp, vp, None, scale, fused))
        ctx.save_for_backward(q, k, v, out, *([lse] if with_lse else []))
        # not the plan's prefix (a split_tree.SegmentKV, which holds this layer's k, v): that would be a
        # reference cycle through the autograd graph, which Python's garbage collector cannot see
        ctx.plan, ctx.scale, ctx.fused = dataclasses.replace(plan, prefix=None), scale, fused
        ctx.prefix = prefix
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205 - autograd.Function protocol
        q, k, v, out, *lse = ctx.saved_tensors
        plan, scale, fused, prefix = ctx.plan, ctx.scale, ctx.fused, ctx.prefix
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        off = plan.query_start
        for qa, qb, ranges in plan.blocks:
            kb, vb, mask = _block_inputs(k[0], v[0], plan, qa, qb, ranges)
            qs = slice(qa - off, qb - off)
            if lse:
                gq, gk, gv = _partial_attention_backward(
                    grad_out[:, :, qs], q[:, :, qs], kb, vb, out[:, :, qs], lse[0][:, :, qs], mask, scale, fused
                )
            else:
                with torch.enable_grad():
                    qb_, kb, vb = (t.detach().requires_grad_() for t in (q[:, :, qs], kb, vb))
                    o = _sdpa(qb_, kb, vb, mask, scale)
                    gq, gk, gv = torch.autograd.grad(o, (qb_, kb, vb), grad_out[:, :, qs])
            dq[:, :, qs] += gq
            offset = 0
            for a, b in ranges:
                dk[:, :, a - off : b - off] += gk[:, :, offset : offset + b - a]
                dv[:, :, a - off : b - off] += gv[:, :, offset : offset + b - a]
                offset += b - a
        if prefix is not None:
            sink_k, sink_v = prefix[2], prefix[3]
            for qa, qb, ka, kb in _prefix_tiles(plan, fused):
                qs = slice(qa - off, qb - off)
                kp, vp = prefix[0][None, :, ka:kb], prefix[1][None, :, ka:kb]
                gq, gk, gv = _partial_attention_backward(
                    grad_out[:, :, qs], q[:, :, qs], kp, vp, out[:, :, qs], lse[0][:, :, qs], None, scale, fused
                )
                dq[:, :, qs] += gq
                if sink_k is not None:  # a given key's gradient goes to the prefix's sink, if it wants one
                    sink_k[:, ka:kb] += gk[0]
                    sink_v[:, ka:kb] += gv[0]
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
