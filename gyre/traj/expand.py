"""A tree back to separate sequences, one per root-to-leaf path: the reference tree training must match.

Running the model on each path alone, at positions 0..L-1, must give the same per-token logprobs as
one tree-packed pass in which each token attends to its ancestors at position `depth`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gyre.traj.tree import TrajectoryTree


@dataclass(frozen=True)
class PathSequence:
    nodes: np.ndarray  # [L] int64 token indices in the tree, root first
    tokens: np.ndarray  # [L] int32
    positions: np.ndarray  # [L] int32 (the tree's depth: 0..L-1)
    policy: np.ndarray  # [L] bool
    logprob: np.ndarray  # [L] float32 behaviour logprobs, 0 on context

    @property
    def n_tokens(self) -> int:
        return int(self.nodes.shape[0])


def path_sequence(tree: TrajectoryTree, leaf: int) -> PathSequence:
    nodes = tree.path_to(leaf)
    return PathSequence(
        nodes=nodes,
        tokens=tree.tokens[nodes],
        positions=tree.depth[nodes],
        policy=tree.policy[nodes],
        logprob=tree.logprob[nodes],
    )


def expand_paths(tree: TrajectoryTree, leaves: Sequence[int] | np.ndarray | None = None) -> list[PathSequence]:
    """One sequence per leaf (default: every leaf of the tree, ascending)."""
    chosen = tree.leaves() if leaves is None else leaves
    return [path_sequence(tree, int(leaf)) for leaf in chosen]
