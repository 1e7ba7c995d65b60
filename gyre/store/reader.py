"""Open and validate trajectory shards; every way a shard can be bad becomes a ShardError.

`read_shard` checks, in order: the file opens as HDF5 (a truncated or half-written file does not),
the schema name and version, every group and dataset with its length and type, every dataset's
crc32, then the offsets and tree structure. Only then does it hand out rollouts, so nothing from a
corrupt shard reaches training.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from gyre.store.schema import (
    CALL_COLUMNS,
    CALL_FIELD_COLUMN,
    GRADE_STATUSES,
    ROUTED_DTYPE,
    ROUTED_EXPERTS,
    ROUTED_VERSION,
    SCHEMA_NAME,
    STR,
    SUPPORTED_VERSIONS,
    TABLE_LENGTH_ATTR,
    TABLES,
    Column,
    RolloutMeta,
    ShardError,
    checksum,
)
from gyre.traj.tree import ROLES, CallInfo, TrajectoryTree

Table = dict[str, np.ndarray]
_CALL_FIELDS = [CALL_FIELD_COLUMN.get(f.name, f.name) for f in fields(CallInfo)]  # /calls columns, CallInfo order
assert sorted(_CALL_FIELDS) == sorted(c.name for c in CALL_COLUMNS), "/calls columns and CallInfo fields differ"


@dataclass(frozen=True)
class ShardRollout:
    """One stored rollout: its tree, per-token loss weight [N] float32 (as a sampled tree has), record."""

    tree: TrajectoryTree
    loss_weight: np.ndarray
    meta: RolloutMeta
    shard: str

    @property
    def n_tokens(self) -> int:
        return self.tree.n_tokens

    @property
    def rollout_id(self) -> str:
        return self.tree.rollout_id


@dataclass
class Shard:
    """A validated shard held in memory as its three tables of columns."""

    path: Path
    attrs: dict[str, Any]
    tokens: Table
    calls: Table
    rollouts: Table
    routed_experts: np.ndarray | None = None  # [n_tokens, MoE layers, top-k] (version 3), None without

    @property
    def n_rollouts(self) -> int:
        return int(self.rollouts["rollout_id"].shape[0])

    def index_of(self, rollout_id: str) -> int:
        hits = np.flatnonzero(self.rollouts["rollout_id"] == rollout_id)
        if hits.size == 0:
            raise KeyError(f"rollout {rollout_id!r} is not in {self.path} (it has {self.n_rollouts} rollouts)")
        return int(hits[0])

    def meta(self, i: int) -> RolloutMeta:
        r = self.rollouts

        def opt(name: str) -> float | None:
            value = float(r[name][i])
            return None if np.isnan(value) else value

        versions = str(r["weight_versions"][i])
        return RolloutMeta(
            group_id=str(r["group_id"][i]),
            task_id=str(r["task_id"][i]),
            task_family=str(r["task_family"][i]),
            harness=str(r["harness"][i]),
            grade_status=GRADE_STATUSES[int(r["grade_status"][i])],
            score=opt("score"),
            reward=opt("reward"),
            advantage=opt("advantage"),
            exclusion_reason=str(r["exclusion_reason"][i]),
            grade_reason=str(r["grade_reason"][i]),
            weight_versions=tuple(versions.split(",")) if versions else (),
        )

    def rollout(self, i: int) -> ShardRollout:
        r, t, c = self.rollouts, self.tokens, self.calls
        ts = slice(int(r["token_offset"][i]), int(r["token_offset"][i] + r["n_tokens"][i]))
        cs = slice(int(r["call_offset"][i]), int(r["call_offset"][i] + r["n_calls"][i]))
        rows = zip(*(c[name][cs].tolist() for name in _CALL_FIELDS), strict=True)  # Python scalars
        calls = [CallInfo(call_id, ROLES[role], *rest) for call_id, role, *rest in rows]
        tree = TrajectoryTree(
            rollout_id=str(r["rollout_id"][i]),
            tokens=t["token_id"][ts],
            parent=t["parent"][ts],
            depth=t["depth"][ts],
            policy=t["policy"][ts],
            logprob=t["logprob"][ts],
            call_id=t["call_id"][ts],
            role=t["role"][ts],
            calls=calls,
            routed_experts=None if self.routed_experts is None else self.routed_experts[ts],
        )
        return ShardRollout(tree=tree, loss_weight=t["loss_weight"][ts], meta=self.meta(i), shard=str(self.path))

    def __iter__(self) -> Iterator[ShardRollout]:
        return (self.rollout(i) for i in range(self.n_rollouts))

    def trainable(self) -> Iterator[ShardRollout]:
        """Rollouts that may be trained: excluded ones (failed evaluations etc.) never are."""
        return (self.rollout(i) for i in np.flatnonzero(~self.rollouts["excluded"]))


def read_shard(path: str | Path, *, verify_checksums: bool = True) -> Shard:
    """Load and validate a whole shard; raise ShardError naming the path and the problem."""
    path = Path(path)
    try:
        f = h5py.File(path, "r", locking=False)
    except FileNotFoundError:
        raise
    except Exception as e:  # h5py reports a damaged file as OSError, ValueError, ... depending on the damage
        raise ShardError(path, f"cannot be opened as HDF5 ({e}); truncated, half-written or not an HDF5 file") from e
    try:
        with f:
            attrs = _check_header(path, f)
            tables = {name: _read_table(path, f, name, attrs, verify_checksums) for name in TABLES}
            routed = _read_routed_experts(path, f, attrs, verify_checksums)
    except ShardError:
        raise
    except Exception as e:  # damage deeper in the file surfaces from h5py with any exception type
        raise ShardError(path, f"unreadable ({type(e).__name__}: {e})") from e
    _check_consistency(path, tables)
    return Shard(path=path, attrs=attrs, tokens=tables["tokens"], calls=tables["calls"], rollouts=tables["rollouts"],
                 routed_experts=routed)  # fmt: skip


def _read_routed_experts(path: Path, f: h5py.File, attrs: dict[str, Any], verify: bool) -> np.ndarray | None:
    """/tokens/routed_experts: required in a version-3 shard, absent before."""
    ds = f["tokens"].get(ROUTED_EXPERTS)
    version, n = int(attrs["schema_version"]), int(attrs["n_tokens"])
    if (ds is None) != (version < ROUTED_VERSION):
        raise ShardError(path, f"schema_version {version} with{'out' if ds is None else ''} /tokens/{ROUTED_EXPERTS}")
    if ds is None:
        return None
    if ds.ndim != 3 or ds.shape[0] != n or ds.dtype != np.dtype(ROUTED_DTYPE):
        raise ShardError(
            path, f"/tokens/{ROUTED_EXPERTS} is {ds.dtype} {ds.shape}, expected int16 ({n}, layers, top-k)"
        )
    values = np.ascontiguousarray(ds[()], dtype=ROUTED_DTYPE)
    if verify and int(ds.attrs.get("crc32", -1)) != zlib.crc32(values.view(np.uint8)) & 0xFFFFFFFF:
        raise ShardError(path, f"/tokens/{ROUTED_EXPERTS}: checksum mismatch")
    return values


def read_header(path: str | Path) -> dict[str, Any]:
    """The file attributes after checking the schema name and version (cheap: no dataset is read)."""
    path = Path(path)
    try:
        with h5py.File(path, "r", locking=False) as f:
            return _check_header(path, f)
    except (ShardError, FileNotFoundError):
        raise
    except Exception as e:
        raise ShardError(path, f"cannot be opened as HDF5 ({e}); truncated, half-written or not an HDF5 file") from e


def _check_header(path: Path, f: h5py.File) -> dict[str, Any]:
    attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
    if attrs.get("schema") != SCHEMA_NAME:
        raise ShardError(
            path, f"schema attribute is {attrs.get('schema')!r}, expected {SCHEMA_NAME!r}: not a gyre shard"
        )
    version = attrs.get("schema_version")
    supported = ", ".join(map(str, SUPPORTED_VERSIONS))
    if not isinstance(version, (int, np.integer)):
        raise ShardError(path, f"schema_version is {version!r}, not an integer: not a valid gyre shard")
    if int(version) > max(SUPPORTED_VERSIONS):
        raise ShardError(path, f"schema_version {version} is newer than this gyre reads ({supported}): upgrade gyre")
    if int(version) not in SUPPORTED_VERSIONS:
        raise ShardError(
            path, f"schema_version {version} is no longer read by this gyre ({supported}): convert the shard"
        )
    missing = [name for name in TABLE_LENGTH_ATTR.values() if name not in attrs]
    if missing:
        raise ShardError(path, f"file attributes {missing} are missing")
    return attrs


def _read_table(path: Path, f: h5py.File, table: str, attrs: dict[str, Any], verify: bool) -> Table:
    group = f.get(table)
    if not isinstance(group, h5py.Group):
        raise ShardError(path, f"group /{table} is missing")
    length = int(attrs[TABLE_LENGTH_ATTR[table]])
    out: Table = {}
    for column in TABLES[table]:
        where = f"/{table}/{column.name}"
        ds = group.get(column.name)
        if ds is None and column.since > int(attrs["schema_version"]):  # written before the column existed
            out[column.name] = np.full(length, column.default, dtype=column.numpy_dtype())
            continue
        if not isinstance(ds, h5py.Dataset):
            raise ShardError(path, f"dataset {where} is missing")
        if ds.shape != (length,):
            raise ShardError(
                path, f"{where} has shape {ds.shape}, expected ({length},) from {TABLE_LENGTH_ATTR[table]}"
            )
        _check_dtype(path, where, ds, column)
        values = ds.asstr()[()] if column.kind == STR else ds[()]
        values = np.asarray(values, dtype=column.numpy_dtype())
        if verify:
            stored = ds.attrs.get("crc32")
            if stored is None:
                raise ShardError(path, f"{where} has no crc32 attribute")
            computed = checksum(values, column)
            if int(stored) != computed:
                raise ShardError(path, f"{where}: checksum mismatch (stored crc32 {int(stored)}, computed {computed})")
        out[column.name] = values
    return out


def _check_dtype(path: Path, where: str, ds: h5py.Dataset, column: Column) -> None:
    if column.kind == STR:
        ok = h5py.check_string_dtype(ds.dtype) is not None
    else:
        ok = ds.dtype.kind == np.dtype(column.kind).kind and ds.dtype.itemsize == np.dtype(column.kind).itemsize
    if column.enum is not None:  # an older file may know fewer names, never other codes
        expected = {name: code for code, name in enumerate(column.enum)}
        stored = h5py.check_enum_dtype(ds.dtype)
        ok = ok and stored is not None and stored.items() <= expected.items()
    if not ok:
        raise ShardError(
            path, f"{where} has type {ds.dtype} {h5py.check_enum_dtype(ds.dtype) or ''}, expected {column.kind}"
        )


def _check_consistency(path: Path, tables: dict[str, Table]) -> None:
    r, t, c = tables["rollouts"], tables["tokens"], tables["calls"]
    for what, offsets, counts, total in (
        ("token", r["token_offset"], r["n_tokens"], t["token_id"].shape[0]),
        ("call", r["call_offset"], r["n_calls"], c["call_id"].shape[0]),
    ):
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])[: counts.shape[0]]
        if np.any(counts < 0) or not np.array_equal(offsets, starts) or int(counts.sum()) != total:
            raise ShardError(path, f"/rollouts {what}_offset/n_{what}s do not tile the {total} rows of /{what}s")
    n = t["token_id"].shape[0]
    index = np.int32 if n < 2**31 else np.int64  # 4-byte index arithmetic halves the memory traffic
    first = np.repeat(r["token_offset"].astype(index), r["n_tokens"])  # row of each token's rollout start
    parent = t["parent"]
    global_parent = first + parent  # -1 + first on roots; only read where parent >= 0
    if np.any((parent < -1) | (global_parent >= np.arange(n, dtype=index))):
        raise ShardError(path, "/tokens/parent is not -1 or an earlier token of the same rollout")
    expected_depth = np.where(parent < 0, 0, np.take(t["depth"], global_parent, mode="clip") + 1)
    if np.any(t["depth"] != expected_depth):
        raise ShardError(path, "/tokens/depth is not parent's depth + 1")
    weighted = t["loss_weight"] != 0
    if np.any(weighted & ~t["policy"]):
        raise ShardError(path, "/tokens/loss_weight is non-zero on a context token")
    if np.any(weighted & np.repeat(r["excluded"], r["n_tokens"])):
        raise ShardError(path, "/tokens/loss_weight is non-zero on an excluded rollout")
    n_tokens_of_call = np.repeat(r["n_tokens"], r["n_calls"])
    if np.any((c["leaf"] < 0) | (c["leaf"] >= n_tokens_of_call)):
        raise ShardError(path, "/calls/leaf points outside its rollout's tokens")
