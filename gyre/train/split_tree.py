"""Trees larger than a micro-batch, trained exactly in segments of at most the budget.

The packed (depth-first) tree is cut into segments of consecutive tokens [a, b). Every ancestor, in an
earlier segment, of a segment's token lies on the root path of the segment's first token a (a subtree is
a contiguous range in depth-first order), so one path of cached keys/values per layer, indexed by depth,
serves every segment (PathKV): the segment's queries attend to that path plus the segment, each token at
the position of its depth.

Segments are trained in reverse order: each is recomputed with gradient against the cached path, and
sum(g * logp) over its targets is backpropagated together with the gradient that later segments left
on its own keys/values; the attention kernel adds the gradient of the cached keys/values in place to
the path's gradient slots. When the previous segment starts on another branch, the part of its root
path not shared with this one is recomputed without gradient (once per token at most; the last
segment's whole root path at the start).

The loss couples all segments (GSPO's ratio is over the whole rollout), so g = dloss/dlogp is only
known once every logprob is. A loss whose gradient is c * loss_weight (GSPO on one rollout, a weighted
token loss) is handled in one pass: run with g = loss_weight into an empty gradient, read every
logprob on the way, evaluate the loss once on all of them (exact ratio), scale the gradient by c.
Any other loss gets a second pass with its exact g.

The sum over segments of each segment's direct gradient plus the gradient through the keys/values later
segments read is the whole tree's gradient: logprobs and gradients equal whole-tree training up to
floating-point summation order. Peak memory: one segment's activations (its logits in row chunks,
gyre/train/chunked_logprobs.py, never [segment x vocab]) plus the path, 4 x layers x depth x key/value width
floats (keys, values and their gradients), whatever the tree's size; beyond that only index arrays of the
tree (a few int64 per token) and per-segment index arrays of the path's length. The path is a floor of
exact training in one sweep: every cached key/value is read by later segments' queries, and its gradient
collects over all of them until the segment that made it is reached. It grows with the deepest path (the
context), not with the tree's tokens. A segment's k, v (kept for the path and its gradient) are dropped
after its backward pass: they are views of its key/value projection, which the attention's autograd
context would otherwise keep alive for every segment (a cycle through the autograd graph that Python's garbage collector cannot see).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gyre.train.chunked_logprobs import TargetLogprobs, hidden_states
from gyre.train.routing_replay import replaying
from gyre.train.tree_attention import Prefix, plan_from_parents
from gyre.train.tree_pack import SplitTreeBatch

LossFn = Callable[[torch.Tensor, Any], tuple[torch.Tensor, dict[str, float]]]


class PathKV:
    """Keys/values (and, backward, their gradients) of one root path per layer, [Hkv, depth, D] by depth."""

    def __init__(self, n_slots: int, gradients: bool = False) -> None:
        self.n_slots, self.gradients = n_slots, gradients
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.gk: dict[int, torch.Tensor] = {}
        self.gv: dict[int, torch.Tensor] = {}

    def ensure(self, layer: int, like: torch.Tensor) -> None:
        if layer not in self.k:
            shape = (like.shape[0], self.n_slots, like.shape[2])
            self.k[layer], self.v[layer] = like.new_zeros(shape), like.new_zeros(shape)
            if self.gradients:
                self.gk[layer], self.gv[layer] = like.new_zeros(shape), like.new_zeros(shape)


class SegmentKV:
    """What one segment's forward reads (the path's first `depth` slots) and leaves (its own keys/values)."""

    def __init__(self, path: PathKV, depth: int, grad: bool) -> None:
        self.path, self.depth, self.grad = path, depth, grad
        self.own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> Prefix:
        """Called by each attention layer with the segment's own k, v [Hkv, n, D]; returns its prefix."""
        self.own[layer] = (k, v)
        self.path.ensure(layer, k)
        if self.depth == 0:
            return None
        d, p = self.depth, self.path
        sinks = (p.gk[layer][:, :d], p.gv[layer][:, :d]) if self.grad else (None, None)
        return (p.k[layer][:, :d], p.v[layer][:, :d], *sinks)

    def write(self, depths: np.ndarray, local: np.ndarray) -> None:
        """Own keys/values of the segment's tokens `local` into the path slots `depths`."""
        d, i = torch.from_numpy(depths), torch.from_numpy(local)
        for layer, (k, v) in self.own.items():
            self.path.k[layer][:, d] = k.detach()[:, i]
            self.path.v[layer][:, d] = v.detach()[:, i]


class _Layout:
    """Index arithmetic of one split tree: root paths, per-segment targets, local parent arrays."""

    def __init__(self, batch: SplitTreeBatch) -> None:
        self.parent = np.asarray(batch.parent.numpy(), dtype=np.int64)  # the batch's own arrays, not copies
        self.depth = np.asarray(batch.positions.numpy(), dtype=np.int64)
        n = self.parent.shape[0]
        idx = np.arange(n)
        n_children = np.bincount(self.parent[self.parent >= 0], minlength=n)
        cont = np.zeros(n, dtype=bool)  # continues the previous token's chain
        cont[1:] = (self.parent[1:] == idx[:-1]) & (n_children[:-1] == 1)
        self.chain_start = np.flatnonzero(~cont)[np.cumsum(~cont) - 1]
        self.segments = batch.segments
        size = batch.segment_tokens
        targets = np.flatnonzero(self.parent >= 0)
        by_seg = self.parent[targets] // size  # a target is read from its parent's logits
        order = np.argsort(by_seg, kind="stable")
        cuts = np.searchsorted(by_seg[order], np.arange(len(self.segments) + 1))
        self.targets = [targets[order[cuts[j] : cuts[j + 1]]] for j in range(len(self.segments))]

    def root_path(self, node: int) -> np.ndarray:
        """The strict ancestors of `node`, by depth (index d holds the ancestor at depth d)."""
        out = np.empty(int(self.depth[node]), dtype=np.int64)
        p = int(self.parent[node])
        while p >= 0:
            s = int(self.chain_start[p])
            out[self.depth[s] : self.depth[p] + 1] = np.arange(s, p + 1)
            p = int(self.parent[s])
        return out

    def segment_parents(self, a: int, b: int, path_depth: int) -> np.ndarray:
        """Local parents of [path (depths 0..path_depth-1), tokens a..b-1]; a parent before a is on the path."""
        p = self.parent[a:b]
        local = np.where(p >= a, path_depth + p - a, self.depth[np.maximum(p, 0)])
        return np.concatenate([np.arange(-1, path_depth - 1), np.where(p >= 0, local, -1)])


def _forward(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    local_parent: np.ndarray,
    path: PathKV,
    depth: int,
    grad: bool,
    routed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, SegmentKV]:
    """Final hidden states [n, H] of the tokens after the first `depth` of local_parent, which come from the
    path (no logits: a segment's logprobs are made in row chunks, gyre/train/chunked_logprobs.py). routed [n, L, k]:
    the tokens' replayed experts (gyre/train/routing_replay.py)."""
    ctx = SegmentKV(path, depth, grad)
    plan = plan_from_parents(local_parent, query_start=depth)
    lo, hi = int(plan.positions.min()), int(plan.positions.max()) + 1
    rope = model.rotary_pos_emb.get_emb(hi - lo, lo)  # the rows of this forward's depths (megatron's, uncached)
    plan = dataclasses.replace(plan, prefix=ctx, rope_table=rope, rope_offset=lo).to(tokens.device)
    with hidden_states(model), replaying(model, routed):
        return model(tokens[None], None, plan)[:, 0], ctx


def _rows(routed: torch.Tensor | None, rows: slice | torch.Tensor) -> torch.Tensor | None:
    return None if routed is None else routed[rows]


def _logprobs_pass(model: torch.nn.Module, batch: SplitTreeBatch, lay: _Layout, device: torch.device) -> torch.Tensor:
    """Every token's logprob [N] (0 at roots), no gradient."""
    tokens, parent = batch.tokens[0].to(device), batch.parent.to(device)
    sampling = batch.sampling.to(device)
    logp = torch.zeros(batch.n_tokens, dtype=torch.float32, device=device)
    path = PathKV(int(batch.positions.max()) + 1)
    head = TargetLogprobs(model)
    with torch.no_grad():
        for j, (a, b) in enumerate(lay.segments):
            d = int(lay.depth[a])
            routed = _rows(batch.routed_experts, slice(a, b))
            hidden, ctx = _forward(model, tokens[a:b], lay.segment_parents(a, b, d), path, d, False, routed)
            t = torch.from_numpy(lay.targets[j]).to(device)
            logp[t] = head(hidden, parent[t] - a, tokens[t], sampling.take(t))
            if b < batch.n_tokens:
                nxt = lay.root_path(b)
                on = np.flatnonzero(nxt >= a)  # the next segment's ancestors in this one, by depth
                ctx.write(on, nxt[on] - a)
    return logp


def split_logprobs(model: torch.nn.Module, batch: SplitTreeBatch, device: torch.device) -> torch.Tensor:
    """log p(token i | its root path) for every packed token as [N] fp32 (0 at roots), no gradient."""
    return _logprobs_pass(model, batch, _Layout(batch), device)


def split_forward_backward(
    model: torch.nn.Module, batch: SplitTreeBatch, mb: Any, loss_fn: LossFn, device: torch.device
) -> dict[str, float]:
    """Accumulate the gradient of loss_fn(logp of the whole tree, mb) into the model's .grad, segment by segment.

    A loss whose gradient is c * loss_weight (GSPO on one rollout: c = dloss/d log ratio / sum of weights;
    a weighted token loss: c = -1) needs no logprob pass first: the backward pass runs with the loss
    weights into an empty gradient, gives every logprob on the way, the loss then gives c, and the
    gradient is scaled by it. Any other loss gets a second backward pass with its exact gradient.
    """
    lay = _Layout(batch)
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    weight = batch.loss_weight.to(device)
    logp = _backward_pass(model, batch, lay, weight, device)
    leaf = logp.clone().requires_grad_()
    loss, metrics = loss_fn(leaf, mb)
    (g,) = torch.autograd.grad(loss, leaf, allow_unused=True)
    g = torch.zeros_like(logp) if g is None else g
    c = float((g * weight).sum() / (weight * weight).sum().clamp(min=1e-30))
    if not torch.allclose(g, c * weight, rtol=1e-5, atol=1e-7 * float(g.abs().max())):
        for p in params:
            p.grad = None
        _backward_pass(model, batch, lay, g, device)
        c = 1.0
    for p, before in zip(params, saved, strict=True):
        if p.grad is not None:
            p.grad.mul_(c)
            if before is not None:
                p.grad.add_(before)
        else:
            p.grad = before
    return {name: float(value) for name, value in metrics.items()}


def _backward_pass(
    model: torch.nn.Module, batch: SplitTreeBatch, lay: _Layout, g: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """Backpropagate sum(g * logp) over the whole tree, segments in reverse order; returns logp [N] (0 at roots)."""
    tokens, parent = batch.tokens[0].to(device), batch.parent.to(device)
    sampling = batch.sampling.to(device)
    size = batch.segment_tokens
    logp = torch.zeros(batch.n_tokens, dtype=torch.float32, device=device)
    path = PathKV(int(batch.positions.max()) + 1, gradients=True)
    head = TargetLogprobs(model)
    later = np.zeros(0, dtype=np.int64)  # root path of the segment processed before (the next one in tree order)
    for j in range(len(lay.segments) - 1, -1, -1):
        a, b = lay.segments[j]
        here = lay.root_path(a)
        q_depth = np.flatnonzero(later >= a)  # this segment's tokens that later segments attended to
        q_local = later[q_depth] - a
        qd = torch.from_numpy(q_depth).to(device)
        own_grad = {i: (path.gk[i][:, qd].clone(), path.gv[i][:, qd].clone()) for i in path.gk}
        m = min(len(here), len(later))
        shared = int(np.argmin(here[:m] == later[:m])) if not np.array_equal(here[:m], later[:m]) else m
        for i in path.gk:  # slots from `shared` on get tokens no later segment attended to
            path.gk[i][:, shared:].zero_()
            path.gv[i][:, shared:].zero_()
        _recompute_path(model, tokens, here, shared, size, path, batch.routed_experts)
        d = int(lay.depth[a])
        routed = _rows(batch.routed_experts, slice(a, b))
        hidden, ctx = _forward(model, tokens[a:b], lay.segment_parents(a, b, d), path, d, True, routed)
        t = torch.from_numpy(lay.targets[j]).to(device)
        logp_t = head(hidden, parent[t] - a, tokens[t], sampling.take(t))
        logp[t] = logp_t.detach()
        objective = (g[t] * logp_t).sum()
        ql = torch.from_numpy(q_local).to(device)
        for i, (gk, gv) in own_grad.items():
            k, v = ctx.own[i]
            objective = objective + (k[:, ql] * gk).sum() + (v[:, ql] * gv).sum()
        objective.backward()
        ctx.own.clear()  # k, v hold their graph (freed by backward, but its nodes live while they do)
        later = here
    return logp


def _recompute_path(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    path_nodes: np.ndarray,
    start: int,
    size: int,
    path: PathKV,
    routed: torch.Tensor | None = None,
) -> None:
    """Keys/values of path_nodes[start:] (a chain below the slots already held) into the path, no gradient."""
    with torch.no_grad():
        for d0 in range(start, len(path_nodes), size):
            d1 = min(d0 + size, len(path_nodes))
            nodes = torch.from_numpy(path_nodes[d0:d1]).to(tokens.device)
            rows = _rows(routed, nodes.cpu())
            _, ctx = _forward(model, tokens[nodes], np.arange(-1, d1 - 1), path, d0, False, rows)
            ctx.write(np.arange(d0, d1), np.arange(d1 - d0))
