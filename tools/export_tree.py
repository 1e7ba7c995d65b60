"""Export one rollout's trajectory tree from a shard as JSON.

    python -m tools.export_tree shard.h5 --rollout s3-r7 > tree.json
    python -m tools.export_tree shard.h5 --index 0 --out tree.json

Column-oriented: "tokens" holds one list per token column (parent and call leaves are indices into
these lists), "calls" one object per call, "meta" the rollout record. `tree_from_json` reads it back.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from gyre.store.reader import ShardRollout
from gyre.traj.tree import ROLES, CallInfo, TrajectoryTree
from tools.shard_cli import add_rollout_choice, chosen_rollout


def rollout_to_json(rollout: ShardRollout) -> dict[str, Any]:
    tree = rollout.tree
    leaves = tree.leaves()
    return {
        "rollout_id": tree.rollout_id,
        "shard": rollout.shard,
        "n_tokens": tree.n_tokens,
        "n_paths": int(leaves.size),
        "expanded_tokens": int((tree.depth[leaves] + 1).sum()),
        "role_names": list(ROLES),
        "meta": asdict(rollout.meta),
        "calls": [asdict(c) for c in tree.calls],
        "tokens": {
            "token_id": tree.tokens.tolist(),
            "parent": tree.parent.tolist(),
            "depth": tree.depth.tolist(),
            "policy": tree.policy.astype(bool).tolist(),
            "logprob": tree.logprob.tolist(),
            "call_id": tree.call_id.tolist(),
            "role": tree.role.tolist(),
            "loss_weight": rollout.loss_weight.tolist(),
        },
    }


def tree_from_json(doc: dict[str, Any]) -> tuple[TrajectoryTree, np.ndarray]:
    """The tree and its loss weight back from `rollout_to_json` output."""
    t = doc["tokens"]
    tree = TrajectoryTree(
        rollout_id=doc["rollout_id"],
        tokens=np.asarray(t["token_id"], dtype=np.int32),
        parent=np.asarray(t["parent"], dtype=np.int32),
        depth=np.asarray(t["depth"], dtype=np.int32),
        policy=np.asarray(t["policy"], dtype=bool),
        logprob=np.asarray(t["logprob"], dtype=np.float32),
        call_id=np.asarray(t["call_id"], dtype=np.int64),
        role=np.asarray(t["role"], dtype=np.uint8),
        calls=[CallInfo(**c) for c in doc["calls"]],
    )
    return tree, np.asarray(t["loss_weight"], dtype=np.float32)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shard", type=Path)
    add_rollout_choice(ap)
    ap.add_argument("--out", type=Path, help="write here instead of stdout")
    args = ap.parse_args(argv)
    rollout = chosen_rollout("export_tree", args.shard, args.rollout, args.index)
    if rollout is None:
        return 1
    text = json.dumps(rollout_to_json(rollout))
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
