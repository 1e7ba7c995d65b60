"""Write trajectory shards atomically: a reader sees either no file or a complete, checksummed one.

The rollouts are validated as they are added (the error names the rollout and what to fix) and the
file is written on close: to a hidden temp file in the target directory, fsynced, then renamed with
os.replace (atomic within one filesystem) and the directory fsynced. A failure at any point removes
the temp file; a crash leaves at most a hidden `.<name>.<pid>.<rand>.tmp`, which readers ignore.

No HDF5 file locks (`locking=False` here and in the reader): a temp file has one writer and a renamed shard
never changes, while HDF5's advisory locks failed reads with "unable to lock file" (EAGAIN) when a shard was
read by one thread of a process (the in-process cell, the group writer's planning) as another opened it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import uuid
import zlib
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import h5py
import numpy as np

from gyre.fsutil import fsync_path
from gyre.store.schema import (
    FILE_ATTRS,
    GRADE_CODE,
    LIBVER,
    ROUTED_DTYPE,
    ROUTED_EXPERTS,
    ROUTED_VERSION,
    SCHEMA_NAME,
    SCHEMA_VERSION,
    SHARD_SUFFIX,
    STR,
    TABLE_DESCRIPTIONS,
    TABLE_LENGTH_ATTR,
    TABLES,
    Column,
    RolloutMeta,
    checksum,
)
from gyre.traj.tree import ROLE_CODE, ROLES, CallInfo, TrajectoryTree


class SampledLike(Protocol):
    """A bounded-sampling result: the sampled subtree and its per-token loss weight [N] float32."""

    tree: TrajectoryTree
    loss_weight: np.ndarray


def gyre_version() -> str:
    try:
        return metadata.version("gyre")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def tree_problems(tree: TrajectoryTree, loss_weight: np.ndarray) -> list[str]:
    """Structural checks a shard's tree must pass; empty when the tree is well formed."""
    n = tree.n_tokens
    arrays = {
        "tokens": tree.tokens,
        "parent": tree.parent,
        "depth": tree.depth,
        "policy": tree.policy,
        "logprob": tree.logprob,
        "call_id": tree.call_id,
        "role": tree.role,
        "loss_weight": loss_weight,
    }
    bad_shape = [f"{k} has shape {v.shape}, expected ({n},)" for k, v in arrays.items() if v.shape != (n,)]
    if bad_shape:
        return bad_shape
    out = []
    idx = np.arange(n)
    parent = tree.parent.astype(np.int64)
    if np.any((parent < -1) | (parent >= idx)):
        out.append("parent must be -1 or an earlier token's index (topological order)")
        return out
    roots = parent < 0
    expected_depth = np.where(roots, 0, tree.depth[np.maximum(parent, 0)].astype(np.int64) + 1)
    if np.any(tree.depth != expected_depth):
        out.append(
            f"depth is not parent's depth + 1 (0 at roots) at token {int(np.argmax(tree.depth != expected_depth))}"
        )
    if np.any(tree.role >= len(ROLES)):
        out.append(f"role codes must be < {len(ROLES)} ({', '.join(ROLES)})")
    if not np.all(np.isfinite(loss_weight)) or np.any(loss_weight < 0):
        out.append("loss_weight must be finite and >= 0")
    if np.any(loss_weight[~tree.policy.astype(bool)] != 0):
        out.append("loss_weight is non-zero on a context token: only policy tokens may be trained")
    for call in tree.calls:
        if not 0 <= call.leaf < n:
            out.append(f"call {call.call_id}: leaf {call.leaf} is outside the tree's {n} tokens")
        if call.role not in ROLE_CODE:
            out.append(f"call {call.call_id}: unknown role {call.role!r} (known: {', '.join(ROLES)})")
    return out


class ShardWriter:
    """Collect rollouts, then write one shard atomically on close (or on leaving a `with` block).

    `add` takes a TrajectoryTree with an explicit loss weight, or a sampled tree (anything with
    `.tree` and `.loss_weight`). Excluded rollouts keep their tree for analysis and get zero loss
    weight. Leaving the `with` block by an exception writes nothing.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        run_id: str,
        step: int,
        producer: Mapping[str, Any] | None = None,
        overwrite: bool = False,
    ) -> None:
        self.path = Path(path)
        if self.path.suffix != SHARD_SUFFIX:
            raise ValueError(
                f"shard path {self.path} must end in {SHARD_SUFFIX} (streaming readers only look for those)"
            )
        if self.path.exists() and not overwrite:
            raise FileExistsError(f"shard {self.path} exists; shards are immutable, pick a new name")
        self.run_id = run_id
        self.step = step
        self.producer = {"host": socket.gethostname(), "pid": os.getpid(), "argv": sys.argv, **(producer or {})}
        self._trees: list[TrajectoryTree] = []
        self._weights: list[np.ndarray] = []
        self._metas: list[RolloutMeta] = []
        self._closed = False

    def add(self, tree: TrajectoryTree | SampledLike, meta: RolloutMeta, loss_weight: np.ndarray | None = None) -> None:
        if self._closed:
            raise RuntimeError(f"shard writer for {self.path} is closed")
        if not isinstance(tree, TrajectoryTree):  # a sampled tree carries its own loss weight
            if loss_weight is None:
                loss_weight = tree.loss_weight
            tree = tree.tree
        if loss_weight is None:
            raise ValueError(f"rollout {tree.rollout_id}: give loss_weight (or add the bounded-sampling result)")
        weight = np.asarray(loss_weight, dtype=np.float32)
        problems = meta.problems() + tree_problems(tree, weight)
        if any(t.rollout_id == tree.rollout_id for t in self._trees):
            problems.append("already added to this shard")
        if problems:
            raise ValueError(f"rollout {tree.rollout_id} cannot be stored: " + "; ".join(problems))
        if meta.excluded:
            weight = np.zeros_like(weight)
        if not meta.weight_versions:
            meta = replace(meta, weight_versions=tuple(dict.fromkeys(c.weight_version for c in tree.calls)))
        self._trees.append(tree)
        self._weights.append(weight)
        self._metas.append(meta)

    def __len__(self) -> int:
        return len(self._trees)

    def close(self) -> Path:
        """Write the shard (temp file, fsync, rename) and return its path."""
        if self._closed:
            return self.path
        self._closed = True
        tables = self._tables()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with h5py.File(tmp, "w", libver=LIBVER, locking=False) as f:
                self._write(f, tables)
            fsync_path(tmp)
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_path(self.path.parent)
        return self.path

    def abort(self) -> None:
        self._closed = True

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _tables(self) -> dict[str, dict[str, np.ndarray]]:
        calls = [c for t in self._trees for c in t.calls]
        return {
            "tokens": _token_table(self._trees, self._weights),
            "calls": _call_table(calls),
            "rollouts": _rollout_table(self._trees, self._metas),
        }

    def _write(self, f: h5py.File, tables: dict[str, dict[str, np.ndarray]]) -> None:
        routed = self._routed_experts()
        attrs: dict[str, Any] = {
            "schema": SCHEMA_NAME,
            "schema_version": np.int64(SCHEMA_VERSION if routed is None else ROUTED_VERSION),
            "description": "Gyre trajectory shard: prefix-shared token trees of agent rollouts; see docs/hdf5.md in the Gyre repository",
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "gyre_version": gyre_version(),
            "run_id": self.run_id,
            "step": np.int64(self.step),
            "producer": json.dumps(self.producer, default=str),
        }
        for table, length_attr in TABLE_LENGTH_ATTR.items():
            attrs[length_attr] = np.int64(len(next(iter(tables[table].values()))))
        assert set(attrs) == set(FILE_ATTRS), "FILE_ATTRS and the writer disagree"
        f.attrs.update(attrs)
        for table, columns in TABLES.items():
            group = f.create_group(table)
            group.attrs["description"] = TABLE_DESCRIPTIONS[table]
            for column in columns:
                _write_column(group, column, tables[table][column.name])
        if routed is not None:
            ds = f["tokens"].create_dataset(ROUTED_EXPERTS, data=routed)
            ds.attrs["description"] = ("expert ids the engine routed each token to, [token, MoE layer, top-k]; -1 where "
                                       "it ran no forward of the token (routing replay, rl.routing_replay)")  # fmt: skip
            ds.attrs["crc32"] = np.uint32(zlib.crc32(routed.view(np.uint8)) & 0xFFFFFFFF)

    def _routed_experts(self) -> np.ndarray | None:
        """Every tree's routed experts, rows back to back (int16), or None when no tree carries them."""
        routed = [t.routed_experts for t in self._trees]
        if all(r is None for r in routed):
            return None
        shapes = {None if r is None else r.shape[1:] for r in routed}
        if None in shapes or len(shapes) != 1:
            raise ValueError(f"shard {self.path}: rollouts with and without routed experts, or of other shapes "
                             f"({shapes}); one shard holds one run's rollouts")  # fmt: skip
        return np.ascontiguousarray(np.concatenate(routed), dtype=ROUTED_DTYPE)


def _write_column(group: h5py.Group, column: Column, values: np.ndarray) -> None:
    ds = group.create_dataset(column.name, data=values, dtype=column.h5_dtype())
    ds.attrs["description"] = column.description
    if column.units:
        ds.attrs["units"] = column.units
    ds.attrs["crc32"] = np.uint32(checksum(values, column))
    if column.kind == STR:
        ds.attrs["encoding"] = "utf-8"


def write_shard(
    path: str | Path,
    rollouts: list[tuple[TrajectoryTree | SampledLike, RolloutMeta, np.ndarray | None]],
    *,
    run_id: str,
    step: int,
    producer: Mapping[str, Any] | None = None,
) -> Path:
    """One-call form of ShardWriter: rollouts as (tree or sampled tree, meta, loss weight or None)."""
    with ShardWriter(path, run_id=run_id, step=step, producer=producer) as writer:
        for tree, meta, weight in rollouts:
            writer.add(tree, meta, weight)
    return writer.path


def _cat(arrays: list[np.ndarray], dtype: str) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype=dtype)


def _nan_if_none(values: list[float | None]) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=np.float32)


def _strings(values: list[str]) -> np.ndarray:
    return np.array(values, dtype=object).reshape(len(values))


def _token_table(trees: list[TrajectoryTree], weights: list[np.ndarray]) -> dict[str, np.ndarray]:
    return {
        "token_id": _cat([t.tokens for t in trees], "<i4"),
        "parent": _cat([t.parent for t in trees], "<i4"),
        "depth": _cat([t.depth for t in trees], "<i4"),
        "policy": _cat([t.policy for t in trees], "|b1"),
        "logprob": _cat([t.logprob for t in trees], "<f4"),
        "call_id": _cat([t.call_id for t in trees], "<i8"),
        "role": _cat([t.role for t in trees], "|u1"),
        "loss_weight": _cat(weights, "<f4"),
    }


def _call_table(calls: list[CallInfo]) -> dict[str, np.ndarray]:
    return {
        "call_id": np.array([c.call_id for c in calls], dtype="<i8"),
        "role": np.array([ROLE_CODE[c.role] for c in calls], dtype="|u1"),
        "leaf": np.array([c.leaf for c in calls], dtype="<i4"),
        "n_input": np.array([c.n_input for c in calls], dtype="<i4"),
        "n_output": np.array([c.n_output for c in calls], dtype="<i4"),
        "weight_version": _strings([c.weight_version for c in calls]),
        "finish_reason": _strings([c.finish_reason for c in calls]),
        "t_start": np.array([c.t_start for c in calls], dtype="<f8"),
        "t_end": np.array([c.t_end for c in calls], dtype="<f8"),
        "trained": np.array([c.trained for c in calls], dtype="|b1"),
        "exclusion_reason": _strings([c.excluded for c in calls]),
        "temperature": np.array([c.temperature for c in calls], dtype="<f8"),
        "top_p": np.array([c.top_p for c in calls], dtype="<f8"),
        "top_k": np.array([c.top_k for c in calls], dtype="<i4"),
        "min_p": np.array([c.min_p for c in calls], dtype="<f8"),
    }


def _rollout_table(trees: list[TrajectoryTree], metas: list[RolloutMeta]) -> dict[str, np.ndarray]:
    n_tokens = np.array([t.n_tokens for t in trees], dtype=np.int64)
    n_calls = np.array([len(t.calls) for t in trees], dtype=np.int64)
    return {
        "rollout_id": _strings([t.rollout_id for t in trees]),
        "group_id": _strings([m.group_id for m in metas]),
        "task_id": _strings([m.task_id for m in metas]),
        "task_family": _strings([m.task_family for m in metas]),
        "harness": _strings([m.harness for m in metas]),
        "grade_status": np.array([GRADE_CODE[m.grade_status] for m in metas], dtype="|u1"),
        "grade_reason": _strings([m.grade_reason for m in metas]),
        "score": _nan_if_none([m.score for m in metas]),
        "reward": _nan_if_none([None if m.excluded else m.reward for m in metas]),
        "advantage": _nan_if_none([None if m.excluded else m.advantage for m in metas]),
        "excluded": np.array([m.excluded for m in metas], dtype="|b1"),
        "exclusion_reason": _strings([m.exclusion_reason for m in metas]),
        "weight_versions": _strings([",".join(m.weight_versions) for m in metas]),
        "token_offset": np.concatenate([[0], np.cumsum(n_tokens)[:-1]]).astype("<i8")[: len(trees)],
        "n_tokens": n_tokens,
        "call_offset": np.concatenate([[0], np.cumsum(n_calls)[:-1]]).astype("<i8")[: len(trees)],
        "n_calls": n_calls,
    }
