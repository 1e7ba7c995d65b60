"""A tree's chains: maximal runs of consecutive token indices with no branch inside.

A segment's nodes are `start..end-1`, each the only child of the one before; its first node's parent
is the last node of its parent segment. Builders append a call's new tokens as one chain, so a tree
has about as many segments as calls plus branch points, and path questions (which paths cover which
calls, how many policy tokens a set of paths holds) are answered on segments instead of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyre.traj.tree import TrajectoryTree


@dataclass(frozen=True)
class Segments:
    start: np.ndarray  # [S] int64 first node
    end: np.ndarray  # [S] int64 one past the last node
    parent: np.ndarray  # [S] int64 parent segment, -1 at a root
    of_node: np.ndarray  # [N] int64 segment of each node
    n_policy: np.ndarray  # [S] int64 policy tokens in the segment

    @property
    def n_segments(self) -> int:
        return int(self.start.shape[0])

    def leaves(self) -> np.ndarray:
        """Segments without child segments: they end at the tree's leaves."""
        has_child = np.zeros(self.n_segments, dtype=bool)
        has_child[self.parent[self.parent >= 0]] = True
        return np.flatnonzero(~has_child)

    def chain(self, seg: int) -> list[int]:
        """Segments from `seg` up to its root, `seg` first."""
        out = []
        while seg >= 0:
            out.append(seg)
            seg = int(self.parent[seg])
        return out

    def nodes(self, segs: np.ndarray) -> np.ndarray:
        """Node indices of the given segments, ascending if `segs` is."""
        if segs.size == 0:
            return np.zeros(0, np.int64)
        return np.concatenate([np.arange(self.start[s], self.end[s]) for s in segs])


def tree_segments(tree: TrajectoryTree) -> Segments:
    n = tree.n_tokens
    if n == 0:
        empty = np.zeros(0, np.int64)
        return Segments(start=empty, end=empty, parent=empty, of_node=empty, n_policy=empty)
    parent = tree.parent.astype(np.int64)
    n_children = np.bincount(parent[parent >= 0], minlength=n)
    continues = np.zeros(n, dtype=bool)  # node i's chain goes on to i + 1
    continues[:-1] = (n_children[:-1] == 1) & (parent[1:] == np.arange(n - 1))
    start = np.flatnonzero(np.concatenate([[True], ~continues[:-1]]))
    end = np.append(start[1:], n)
    of_node = np.repeat(np.arange(start.shape[0]), end - start)
    first_parent = parent[start]
    seg_parent = np.where(first_parent >= 0, of_node[np.maximum(first_parent, 0)], -1)
    n_policy = np.add.reduceat(tree.policy.astype(np.int64), start)
    return Segments(start=start, end=end, parent=seg_parent, of_node=of_node, n_policy=n_policy)
