"""Bounded sampling: at most K root-to-leaf paths of a rollout's tree enter training, with loss weights.

Candidates are the tree's maximal paths (ending at tree leaves) that hold the leaf of at least one
eligible call: not excluded, role in `roles` (side calls are never trained: their outputs are
context, see gyre/traj/build.py). A path's role is the role of the call that ends it (the eligible
call whose leaf is deepest on it): a compaction's summary branch is a main-summary trajectory even
though it carries the main calls it summarizes. Choice is greedy, up to K times, on
1. the path's role (ROLES order: main > main_summary > subagent > subagent_summary), so every
   trajectory that ends in a main call (the thread after a compaction, a retried reply) comes before
   a summary branch; the main calls a summary branch carries are trained when it is chosen;
2. then more not-yet-covered policy tokens;
3. then the earliest not-yet-covered eligible call.
A path that adds no not-yet-covered eligible call or no policy token is never taken.

The chosen paths' union is the trained subtree. Each of its policy tokens is one target, however
many chosen paths share it, and all get weight 1 / (number of them): a rollout's token losses sum
to its mean, so the number of paths it contributes does not change its weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from gyre.traj.segments import Segments, tree_segments
from gyre.traj.tree import ROLE_CODE, TrajectoryTree

DEFAULT_K = 5
DEFAULT_ROLES: tuple[str, ...] = ("main", "main_summary", "subagent", "subagent_summary")


@dataclass
class SampledTree:
    tree: TrajectoryTree  # union of the chosen paths, re-indexed (still topological)
    loss_weight: np.ndarray  # [N] float32: 1 / n_targets on policy tokens, 0 on context; sums to 1
    source_index: np.ndarray  # [N] int64 index of each token in the full tree
    path_leaves: np.ndarray  # [P] int64 last token of each chosen path (in `tree`), in choice order

    @property
    def n_paths(self) -> int:
        return int(self.path_leaves.shape[0])

    @property
    def n_targets(self) -> int:
        return int(self.tree.policy.sum())


def choose_paths(tree: TrajectoryTree, k: int = DEFAULT_K, roles: Sequence[str] = DEFAULT_ROLES) -> list[int]:
    """Leaves (token indices in `tree`) of at most k chosen root-to-leaf paths, in choice order."""
    if k < 1:
        raise ValueError(f"k is {k}; at least one path per rollout must be allowed")
    unknown = set(roles) - set(ROLE_CODE)
    if unknown:
        raise ValueError(f"unknown roles {sorted(unknown)}; use names from {ROLE_CODE}")
    if "side" in roles:
        raise ValueError("side calls are never trained (their outputs are stored as context); drop 'side' from roles")
    seg = tree_segments(tree)
    calls_by_seg: dict[int, list[tuple[int, int]]] = {}
    end_role: dict[int, tuple[int, int]] = {}  # segment -> (depth, role) of its deepest eligible call's leaf
    for c in tree.calls:
        if not c.excluded and c.role in roles:
            s = int(seg.of_node[c.leaf])
            calls_by_seg.setdefault(s, []).append((ROLE_CODE[c.role], c.call_id))
            end_role[s] = max(end_role.get(s, (-1, 0)), (int(tree.depth[c.leaf]), ROLE_CODE[c.role]))
    chains = {int(leaf): seg.chain(int(leaf)) for leaf in seg.leaves()}
    chains = {leaf: ch for leaf, ch in chains.items() if any(s in calls_by_seg for s in ch)}
    # a chain lists its segments leaf first: the first one holding an eligible call holds the path's last call
    path_role = {leaf: end_role[next(s for s in ch if s in end_role)][1] for leaf, ch in chains.items()}

    covered = np.zeros(seg.n_segments, dtype=bool)
    chosen: list[int] = []
    for _ in range(k):
        best: tuple[tuple[int, int, int], int] | None = None
        for leaf, chain in chains.items():
            key = _gain_key(path_role[leaf], chain, covered, calls_by_seg, seg)
            if key is not None and (best is None or key < best[0]):
                best = (key, leaf)
        if best is None:
            break
        leaf = best[1]
        covered[chains.pop(leaf)] = True
        chosen.append(int(seg.end[leaf]) - 1)
    return chosen


def _gain_key(
    role: int, chain: list[int], covered: np.ndarray, calls_by_seg: dict[int, list[tuple[int, int]]], seg: Segments
) -> tuple[int, int, int] | None:
    new = [s for s in chain if not covered[s]]
    calls = [cid for s in new for _, cid in calls_by_seg.get(s, ())]
    new_policy = int(seg.n_policy[new].sum()) if new else 0
    if not calls or new_policy == 0:
        return None
    return role, -new_policy, min(calls)


def subtree(tree: TrajectoryTree, nodes: np.ndarray) -> TrajectoryTree:
    """The tree restricted to `nodes` (ascending, closed under parents), re-indexed.

    Calls with no token inside are dropped; the others keep their info with the leaf re-indexed. A call whose
    leaf is outside but some of whose generated tokens are inside (a retry sharing the first tokens of a dropped
    reply) is kept with its deepest kept token as leaf: its tokens' behaviour logprobs need its sampling
    parameters.
    """
    remap = np.full(tree.n_tokens, -1, np.int64)
    remap[nodes] = np.arange(nodes.shape[0])
    parent = tree.parent[nodes]
    new_parent = np.where(parent >= 0, remap[np.maximum(parent, 0)], -1)
    if np.any((parent >= 0) & (new_parent < 0)):
        raise ValueError("nodes are not closed under parents; pass whole root paths")
    kept_calls = tree.call_id[nodes]
    deepest = dict(zip(kept_calls.tolist(), remap[nodes].tolist(), strict=True))  # ascending: last write wins
    leaf = {c.call_id: int(remap[c.leaf]) if remap[c.leaf] >= 0 else deepest.get(c.call_id, -1) for c in tree.calls}
    return TrajectoryTree(
        rollout_id=tree.rollout_id,
        tokens=tree.tokens[nodes],
        parent=new_parent.astype(np.int32),
        depth=tree.depth[nodes],
        policy=tree.policy[nodes],
        logprob=tree.logprob[nodes],
        call_id=tree.call_id[nodes],
        role=tree.role[nodes],
        calls=[replace(c, leaf=leaf[c.call_id]) for c in tree.calls if leaf[c.call_id] >= 0],
        routed_experts=None if tree.routed_experts is None else tree.routed_experts[nodes],
    )


def sample_tree(tree: TrajectoryTree, k: int = DEFAULT_K, roles: Sequence[str] = DEFAULT_ROLES) -> SampledTree:
    """The union of the chosen paths, with per-token loss weights (see the module docstring)."""
    leaves = choose_paths(tree, k, roles)
    on_path = np.zeros(tree.n_tokens, dtype=bool)
    seg = tree_segments(tree)
    for leaf in leaves:
        on_path[seg.nodes(np.asarray(seg.chain(int(seg.of_node[leaf]))))] = True
    nodes = np.flatnonzero(on_path)
    sub = subtree(tree, nodes)
    weight = np.zeros(nodes.shape[0], np.float32)
    n_targets = int(sub.policy.sum())
    if n_targets:
        weight[sub.policy] = np.float32(1.0 / n_targets)
    remap = np.searchsorted(nodes, np.asarray(leaves, np.int64))
    return SampledTree(tree=sub, loss_weight=weight, source_index=nodes, path_leaves=remap.astype(np.int64))
