"""Command-line helpers shared by the shard tools: pick one rollout of a shard by id or row."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gyre.store.reader import ShardRollout, read_shard
from gyre.store.schema import ShardError


def add_rollout_choice(ap: argparse.ArgumentParser) -> None:
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--rollout", help="rollout id")
    which.add_argument("--index", type=int, default=0, help="row in /rollouts (default 0)")


def chosen_rollout(tool: str, shard_path: Path, rollout: str | None, index: int) -> ShardRollout | None:
    """The rollout asked for, or None after printing why not (the tool then exits 1)."""
    try:
        shard = read_shard(shard_path)
        index = shard.index_of(rollout) if rollout else index
        if not 0 <= index < shard.n_rollouts:
            raise KeyError(f"index {index} is out of range: {shard_path} has {shard.n_rollouts} rollouts")
    except (ShardError, KeyError) as e:
        print(f"{tool}: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return None
    except FileNotFoundError:  # read_shard turns every other failure to open into a ShardError
        print(f"{tool}: cannot read {shard_path}: no such file", file=sys.stderr)
        return None
    return shard.rollout(index)
