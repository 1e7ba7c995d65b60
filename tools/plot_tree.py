"""Draw one rollout's trajectory tree as a PNG.

    python -m tools.plot_tree shard.h5 --rollout s3-r7 --out tree.png

x is a token's position along its path (its depth); each branch (a run of tokens between branch
points) gets its own row, rows in depth-first order, with a grey connector where it leaves its
parent branch. Colour = role of the call that first reached the token; thin and light = context,
thick and solid = policy-generated; a black tick marks each call's last token.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure  # no pyplot: renders with Agg, no display or global state
from matplotlib.lines import Line2D

from gyre.store.reader import ShardRollout
from gyre.traj.tree import ROLES, TrajectoryTree
from tools.shard_cli import add_rollout_choice, chosen_rollout

ROLE_COLOURS: dict[str, str] = {
    "main": "#1f77b4",
    "main_summary": "#17becf",
    "subagent": "#d62728",
    "subagent_summary": "#ff9896",
    "side": "#7f7f7f",
}


@dataclass(frozen=True)
class Run:
    """Consecutive tokens of one branch with the same role and policy flag: one drawn stroke."""

    x0: int
    x1: int
    row: int
    role: int
    policy: bool


def branch_heads(tree: TrajectoryTree) -> np.ndarray:
    """For each token, the first token of its branch (a root or a child of a branching token)."""
    n = tree.n_tokens
    parent = tree.parent.astype(np.int64)
    n_children = np.bincount(parent[parent >= 0], minlength=n)
    starts = (parent < 0) | (n_children[np.maximum(parent, 0)] > 1)
    head = np.where(starts, np.arange(n), parent)
    while True:  # pointer jumping: O(N log depth), branch starts are fixed points
        jumped = head[head]
        if np.array_equal(jumped, head):
            return head
        head = jumped


def layout(tree: TrajectoryTree) -> tuple[list[Run], dict[int, int], list[tuple[int, int, int]]]:
    """Strokes, the row of each branch head, and connectors (x, parent row, child row)."""
    head = branch_heads(tree)
    heads = np.unique(head)
    children: dict[int, list[int]] = {-1: []}
    for h in heads.tolist():
        p = int(tree.parent[h])
        children.setdefault(-1 if p < 0 else int(head[p]), []).append(h)
    row: dict[int, int] = {}
    stack = sorted(children[-1], reverse=True)
    while stack:  # depth-first; among siblings the deepest attachment first, then the earliest token
        h = stack.pop()
        row[h] = len(row)
        stack += sorted(children.get(h, []), key=lambda c: (int(tree.depth[c]), -c))
    order = np.lexsort((tree.depth, head))
    h, role, pol, depth = head[order], tree.role[order], tree.policy[order].astype(bool), tree.depth[order]
    cut = np.flatnonzero((h[1:] != h[:-1]) | (role[1:] != role[:-1]) | (pol[1:] != pol[:-1])) + 1
    starts, ends = np.concatenate([[0], cut]), np.concatenate([cut, [len(order)]]) - 1
    runs = [
        Run(int(depth[s]), int(depth[e]) + 1, row[int(h[s])], int(role[s]), bool(pol[s]))
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True)
    ]
    connectors = [
        (int(tree.depth[c]), row[int(head[tree.parent[c]])], row[c]) for c in heads.tolist() if tree.parent[c] >= 0
    ]
    return runs, row, connectors


def plot_tree(rollout: ShardRollout, out: Path) -> None:
    tree = rollout.tree
    runs, row, connectors = layout(tree)
    n_rows = max(row.values()) + 1 if row else 1
    fig = Figure(figsize=(12, min(2 + 0.28 * n_rows, 40)))
    ax = fig.subplots()
    for policy, width, alpha in ((False, 2.0, 0.35), (True, 6.0, 1.0)):
        chosen = [r for r in runs if r.policy == policy]
        ax.add_collection(
            LineCollection(
                [[(r.x0, r.row), (r.x1, r.row)] for r in chosen],
                colors=[ROLE_COLOURS[ROLES[r.role]] for r in chosen],
                linewidths=width,
                alpha=alpha,
                capstyle="butt",
            )
        )
    ax.add_collection(LineCollection([[(x, a), (x, b)] for x, a, b in connectors], colors="#aaaaaa", linewidths=0.8))
    head = branch_heads(tree)
    leaves = [c.leaf for c in tree.calls]
    ax.scatter(
        [tree.depth[i] + 1 for i in leaves], [row[int(head[i])] for i in leaves], marker="|", s=60, c="black", lw=1
    )
    ax.set_xlim(0, max(int(tree.depth.max()) + 1 if tree.n_tokens else 1, 1) * 1.02)
    ax.set_ylim(n_rows - 0.5, -0.5)
    ax.set(xlabel="position along the path (tokens)", ylabel="branch (depth-first)")
    used = sorted({r.role for r in runs})
    handles = [Line2D([], [], color=ROLE_COLOURS[ROLES[c]], lw=4, label=ROLES[c]) for c in used]
    handles += [
        Line2D([], [], color="black", lw=2, alpha=0.35, label="context"),
        Line2D([], [], color="black", lw=6, label="policy"),
        Line2D([], [], color="black", lw=0, marker="|", markersize=10, label="call end"),
    ]
    ax.legend(handles=handles, loc="upper right", fontsize=8, ncol=2)
    m = rollout.meta
    reward = "excluded: " + m.exclusion_reason if m.excluded else f"reward {m.reward:.3f}"
    leaves_all = tree.leaves()
    ax.set_title(
        f"{tree.rollout_id}: {tree.n_tokens:,} tree tokens, {len(tree.calls)} calls, {leaves_all.size} paths "
        f"({int((tree.depth[leaves_all] + 1).sum()):,} expanded), {m.grade_status}, {reward}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shard", type=Path)
    add_rollout_choice(ap)
    ap.add_argument("--out", type=Path, required=True, help="PNG path")
    args = ap.parse_args(argv)
    rollout = chosen_rollout("plot_tree", args.shard, args.rollout, args.index)
    if rollout is None:
        return 1
    plot_tree(rollout, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
