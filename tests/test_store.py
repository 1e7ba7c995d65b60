"""HDF5 trajectory shards: round trip, atomic writes, corruption, versions, streaming micro-batches."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import h5py
import numpy as np
import pytest

from gyre.store import (
    END_OF_STREAM,
    RolloutMeta,
    ShardError,
    ShardStream,
    ShardWriter,
    StreamIdleTimeout,
    mark_end_of_stream,
    pack_by_token_budget,
    read_header,
    read_shard,
    write_shard,
)
from gyre.store.schema import FILE_ATTRS, TABLES
from gyre.traj.tree import ROLE_CODE, CallInfo, TrajectoryTree
from tools.synthetic_shard import rollout_average_weight, synthetic_tree

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.unit


def hand_tree(rollout_id: str = "r0") -> TrajectoryTree:
    """System prompt 0-3; call 0 writes 4-5; tool output 6-7; call 1 writes 8-9;
    a summary (call 2) branches off token 3: prompt 10, output 11."""
    m, s = ROLE_CODE["main"], ROLE_CODE["main_summary"]
    return TrajectoryTree(
        rollout_id=rollout_id,
        tokens=np.array([1, 2, 3, 4, 50, 51, 5, 6, 52, 53, 7, 54], dtype=np.int32),
        parent=np.array([-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 3, 10], dtype=np.int32),
        depth=np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 4, 5], dtype=np.int32),
        policy=np.array([0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 0, 1], dtype=bool),
        logprob=np.array([0, 0, 0, 0, -0.5, -0.25, 0, 0, -1, -2, 0, -0.125], dtype=np.float32),
        call_id=np.array([-1, -1, -1, -1, 0, 0, -1, -1, 1, 1, -1, 2], dtype=np.int64),
        role=np.array([m] * 10 + [s, s], dtype=np.uint8),
        calls=[
            CallInfo(0, "main", 5, 4, 2, "v0", "stop", 100.0, 101.5, temperature=0.7, top_p=0.95),
            CallInfo(1, "main", 9, 8, 2, "v1", "stop", 102.0, 103.0, temperature=1.6, top_k=20, min_p=0.05),
            CallInfo(2, "main_summary", 11, 5, 1, "v1", "length", 104.0, 104.5, temperature=0.0),
        ],
    )


def meta(reward: float = 0.5, advantage: float = 0.25, **kw) -> RolloutMeta:
    base = dict(
        group_id="g0",
        task_id="t0",
        task_family="write_value",
        harness="builtin",
        grade_status="ok",
        score=reward,
        reward=reward,
        advantage=advantage,
    )
    return RolloutMeta(**{**base, **kw})


FAILED = dict(grade_status="failed", score=None, reward=None, advantage=None, exclusion_reason="checker crashed")


def weight(tree: TrajectoryTree) -> np.ndarray:
    return rollout_average_weight(tree)


def small_shard(path: Path, n: int = 3, seed: int = 0, prefix: str = "r", failed_last: bool = True) -> Path:
    rng = np.random.default_rng(seed)
    rollouts = []
    for i in range(n):
        tree = synthetic_tree(f"{prefix}{i}", 400, 6, rng)
        m = meta(**FAILED) if failed_last and i == n - 1 else meta(reward=i / n, advantage=i - 1.0)
        rollouts.append((tree, m, weight(tree)))
    return write_shard(path, rollouts, run_id="run-a", step=3, producer={"engine": "embedded"})


def assert_same_tree(a: TrajectoryTree, b: TrajectoryTree) -> None:
    assert a.rollout_id == b.rollout_id
    for name in ("tokens", "parent", "depth", "policy", "logprob", "call_id", "role"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert a.calls == b.calls


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


# --- round trip and self-description -------------------------------------------------------------


def test_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    hand = hand_tree("hand")
    hand.calls[1] = replace(hand.calls[1], trained=False, excluded="truncated record: 2 ids, 1 logprob")
    trees = [hand, synthetic_tree("syn", 3000, 20, rng), synthetic_tree("bad", 500, 5, rng)]
    metas = [meta(0.75, 1.5), meta(0.0, -1.0, grade_status="timeout"), meta(**FAILED)]
    path = write_shard(
        tmp_path / "a.h5", [(t, m, weight(t)) for t, m in zip(trees, metas, strict=True)], run_id="run-a", step=7
    )

    shard = read_shard(path)
    assert shard.attrs["schema"] == "gyre.trajectory_shard" and shard.attrs["schema_version"] == 2
    assert shard.attrs["run_id"] == "run-a" and shard.attrs["step"] == 7
    assert shard.attrs["n_tokens"] == sum(t.n_tokens for t in trees)
    rollouts = list(shard)
    for tree, m, got in zip(trees, metas, rollouts, strict=True):
        assert_same_tree(tree, got.tree)
        if m.excluded:
            assert not got.loss_weight.any()  # excluded rollouts are stored with zero loss weight
        else:
            np.testing.assert_array_equal(got.loss_weight, weight(tree))
    assert rollouts[0].meta == meta(0.75, 1.5, weight_versions=("v0", "v1"))
    assert rollouts[1].meta.grade_status == "timeout"
    assert (
        rollouts[2].meta.excluded
        and rollouts[2].meta.reward is None
        and rollouts[2].meta.exclusion_reason == "checker crashed"
    )
    assert [r.rollout_id for r in shard.trainable()] == ["hand", "syn"]
    assert shard.rollout(shard.index_of("syn")).tree.n_tokens == trees[1].n_tokens


def test_sampled_tree_is_accepted(tmp_path):
    class Sampled:  # the shape of gyre.traj.sampling's result: subtree + per-token loss weight
        def __init__(self, tree, loss_weight):
            self.tree, self.loss_weight = tree, loss_weight

    tree = hand_tree()
    w = np.where(tree.policy, 0.2, 0.0).astype(np.float32)
    with ShardWriter(tmp_path / "s.h5", run_id="r", step=0) as writer:
        writer.add(Sampled(tree, w), meta())
    np.testing.assert_array_equal(read_shard(tmp_path / "s.h5").rollout(0).loss_weight, w)


def test_self_describing_with_plain_h5py_and_h5dump(tmp_path):
    path = small_shard(tmp_path / "a.h5")
    with h5py.File(path) as f:
        assert set(FILE_ATTRS) <= set(f.attrs)
        for table, columns in TABLES.items():
            assert f[table].attrs["description"]
            for column in columns:
                ds = f[table][column.name]
                assert ds.attrs["description"] and "crc32" in ds.attrs, f"/{table}/{column.name}"
        assert h5py.check_enum_dtype(f["tokens/role"].dtype)["subagent"] == ROLE_CODE["subagent"]
    dump = subprocess.run(["h5dump", "-A", str(path)], capture_output=True, text=True, check=True).stdout
    assert '"main_summary"' in dump and '"timeout"' in dump  # enum names, not bare codes
    assert "behaviour log-probability" in dump and '"nats"' in dump
    data = subprocess.run(
        ["h5dump", "-d", "/rollouts/grade_status", str(path)], capture_output=True, text=True, check=True
    )
    assert re.search(r"ok, ok, failed", data.stdout)


def test_docs_name_every_column_and_attribute():
    doc = (REPO / "docs" / "hdf5.md").read_text()
    names = list(FILE_ATTRS) + [f"{c.name}" for cols in TABLES.values() for c in cols]
    missing = [n for n in names if f"`{n}`" not in doc]
    assert not missing, f"docs/hdf5.md does not describe {missing}"


# --- writer refuses what must not be stored ------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t, w: (t, np.ones_like(w)), "non-zero on a context token"),
        (lambda t, w: (t, w[:-1]), "loss_weight has shape"),
        (
            lambda t, w: (_with(t, parent=np.array([-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 10], dtype=np.int32)), w),
            "topological",
        ),
        (lambda t, w: (_with(t, depth=t.depth + 1), w), "depth"),
        (
            lambda t, w: (_with(t, calls=[CallInfo(0, "planner", 5, 4, 2, "v0", "stop", 0.0, 1.0)]), w),
            "unknown role 'planner'",
        ),
        (lambda t, w: (_with(t, calls=[CallInfo(0, "main", 99, 4, 2, "v0", "stop", 0.0, 1.0)]), w), "leaf 99"),
    ],
)
def test_writer_rejects_bad_trees(tmp_path, change, message):
    tree = hand_tree()
    bad_tree, bad_weight = change(tree, weight(tree))
    with ShardWriter(tmp_path / "x.h5", run_id="r", step=0) as writer:
        with pytest.raises(ValueError, match=message):
            writer.add(bad_tree, meta(), bad_weight)


def _with(tree: TrajectoryTree, **changes) -> TrajectoryTree:
    return TrajectoryTree(**{**tree.__dict__, **changes})


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(grade_status="failed", score=None, reward=0.0, advantage=0.0), "failed evaluation must be excluded"),
        (dict(advantage=None), "advantage is None on a trained rollout"),
        (dict(reward=float("nan")), "reward is nan"),
        (dict(grade_status="crashed"), "not one of"),
    ],
)
def test_writer_rejects_bad_records(tmp_path, kw, message):
    with ShardWriter(tmp_path / "x.h5", run_id="r", step=0) as writer:
        with pytest.raises(ValueError, match=message):
            writer.add(hand_tree(), meta(**kw), weight(hand_tree()))


def test_writer_refuses_overwrite_and_odd_names(tmp_path):
    path = small_shard(tmp_path / "a.h5")
    with pytest.raises(FileExistsError, match="immutable"):
        ShardWriter(path, run_id="r", step=0)
    with pytest.raises(ValueError, match=r"must end in \.h5"):
        ShardWriter(tmp_path / "a.hdf5", run_id="r", step=0)


# --- atomic writes -------------------------------------------------------------------------------


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    def broken_replace(src, dst):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="simulated"):
        small_shard(tmp_path / "a.h5")
    assert os.listdir(tmp_path) == []  # neither the shard nor its temp file


def test_exception_in_with_block_writes_nothing(tmp_path):
    with pytest.raises(RuntimeError), ShardWriter(tmp_path / "a.h5", run_id="r", step=0) as writer:
        writer.add(hand_tree(), meta(), weight(hand_tree()))
        raise RuntimeError("producer died")
    assert os.listdir(tmp_path) == []


def test_crash_mid_write_leaves_only_a_hidden_temp_file(tmp_path):
    """A writer process killed halfway through the file: readers never see a shard."""
    script = f"""
import os, gyre.store.writer as w
real = w._write_column
count = [0]
def dying(*a):
    real(*a)
    count[0] += 1
    if count[0] == 20:
        os._exit(9)
w._write_column = dying
import sys; sys.path.insert(0, {str(REPO / "tests")!r})
from test_store import small_shard
small_shard(__import__("pathlib").Path({str(tmp_path / "a.h5")!r}))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    left = os.listdir(tmp_path)
    assert len(left) == 1 and left[0].startswith(".a.h5.") and left[0].endswith(".tmp")
    with pytest.raises(ShardError, match="truncated, half-written"):
        read_shard(tmp_path / left[0])
    mark_end_of_stream(tmp_path)
    stream = ShardStream(tmp_path, 10_000, poll_s=0.01)
    assert list(stream) == [] and stream.excluded == []  # the temp file is not a shard


# --- corruption, truncation, versions ------------------------------------------------------------


def test_checksum_detects_flipped_byte_in_token_data(tmp_path):
    path = small_shard(tmp_path / "a.h5")
    with h5py.File(path) as f:
        offset = f["tokens/token_id"].id.get_offset()
    flip_byte(path, offset + 4 * 17 + 1)
    with pytest.raises(ShardError, match=r"/tokens/token_id: checksum mismatch") as err:
        read_shard(path)
    assert err.value.path == str(path)


def test_checksum_detects_flipped_byte_in_a_string(tmp_path):
    tree = hand_tree()
    path = write_shard(tmp_path / "a.h5", [(tree, meta(task_id="task-UNIQUE-42"), weight(tree))], run_id="r", step=0)
    offset = path.read_bytes().index(b"task-UNIQUE-42")
    flip_byte(path, offset + 5)
    with pytest.raises(ShardError, match=r"/rollouts/task_id: checksum mismatch"):
        read_shard(path)


def test_random_byte_flips_are_caught_or_harmless(tmp_path):
    """Whatever byte is damaged, the reader raises ShardError or returns exactly the original data."""
    src = small_shard(tmp_path / "src.h5", n=2)
    original = read_shard(src)
    data = src.read_bytes()
    target = tmp_path / "x.h5"
    caught = 0
    for offset in np.random.default_rng(0).choice(len(data), size=120, replace=False).tolist():
        damaged = bytearray(data)
        damaged[offset] ^= 0x10
        target.write_bytes(damaged)
        try:
            shard = read_shard(target)
        except ShardError:
            caught += 1
            continue
        for table in ("tokens", "calls", "rollouts"):
            for name, values in getattr(original, table).items():
                np.testing.assert_array_equal(getattr(shard, table)[name], values, err_msg=f"flip at {offset}")
    assert caught > 60


@pytest.mark.parametrize("keep", [lambda n: 0, lambda n: 100, lambda n: n // 2, lambda n: n - 1])
def test_truncated_file_is_a_shard_error(tmp_path, keep):
    path = small_shard(tmp_path / "a.h5")
    os.truncate(path, keep(path.stat().st_size))
    with pytest.raises(ShardError, match="truncated, half-written") as err:
        read_shard(path)
    assert str(path) in str(err.value)


SAMPLING_COLUMNS = ("temperature", "top_p", "top_k", "min_p")


def test_version_1_shards_read_with_default_sampling_parameters(tmp_path):
    """A v1 shard (no sampling columns) reads as temperature 1, no truncation: what its raw logprobs describe."""
    path = write_shard(tmp_path / "v1.h5", [(hand_tree("hand"), meta(), weight(hand_tree("hand")))], run_id="r", step=0)
    with h5py.File(path, "r+") as f:
        for name in SAMPLING_COLUMNS:
            del f["calls"][name]
        f.attrs["schema_version"] = np.int64(1)
    calls = next(iter(read_shard(path))).tree.calls
    assert [(c.temperature, c.top_p, c.top_k, c.min_p) for c in calls] == [(1.0, 1.0, -1, 0.0)] * 3
    with h5py.File(path, "r+") as f:
        f.attrs["schema_version"] = np.int64(2)  # the same file claiming version 2 lacks required columns
    with pytest.raises(ShardError, match="/calls/temperature is missing"):
        read_shard(path)


def test_agent_failed_grade_round_trips_and_version_1_files_still_read(tmp_path):
    agent = meta(0.0, -0.5, grade_status="agent_failed", grade_reason="harness_exit: exit code 3")
    path = write_shard(tmp_path / "a.h5", [(hand_tree("x"), agent, weight(hand_tree("x")))], run_id="r", step=0)
    (back,) = read_shard(path)
    assert (back.meta.grade_status, back.meta.score, back.meta.grade_reason, back.meta.excluded) == (
        "agent_failed",
        0.0,
        "harness_exit: exit code 3",
        False,
    )
    with pytest.raises(ValueError, match="agent_failed grade scores 0"):
        write_shard(tmp_path / "b.h5", [(hand_tree("y"), meta(0.5, 0.1, grade_status="agent_failed"), weight(hand_tree("y")))],
                    run_id="r", step=0)  # fmt: skip
    v1 = small_shard(tmp_path / "v1.h5")  # what a version 1 writer left: no grade_reason column
    with h5py.File(v1, "r+") as f:
        del f["rollouts/grade_reason"]
        f.attrs["schema_version"] = np.int64(1)
    assert [r.meta.grade_reason for r in read_shard(v1)] == ["", "", ""]


def test_unknown_schema_version_and_name(tmp_path):
    path = small_shard(tmp_path / "a.h5")
    with h5py.File(path, "r+") as f:
        f.attrs["schema_version"] = np.int64(4)
    with pytest.raises(ShardError, match=r"schema_version 4 is newer than this gyre reads \(1, 2, 3\): upgrade gyre"):
        read_shard(path)
    with pytest.raises(ShardError, match="schema_version 4"):
        read_header(path)
    with h5py.File(path, "r+") as f:
        f.attrs["schema_version"] = np.int64(0)
    with pytest.raises(ShardError, match="schema_version 0 is no longer read"):
        read_shard(path)
    with h5py.File(path, "r+") as f:
        f.attrs["schema"] = "someone.else"
    with pytest.raises(ShardError, match="not a gyre shard"):
        read_shard(path)


def test_missing_dataset_and_wrong_length(tmp_path):
    path = small_shard(tmp_path / "a.h5")
    copy = shutil.copy(path, tmp_path / "b.h5")
    with h5py.File(path, "r+") as f:
        del f["calls/t_end"]
    with pytest.raises(ShardError, match="dataset /calls/t_end is missing"):
        read_shard(path)
    with h5py.File(copy, "r+") as f:
        f.attrs["n_tokens"] = np.int64(f.attrs["n_tokens"] + 1)
    with pytest.raises(ShardError, match=r"/tokens/token_id has shape"):
        read_shard(copy)


# --- packing and streaming -----------------------------------------------------------------------


class Item:
    def __init__(self, n: int) -> None:
        self.n_tokens = n


def test_pack_by_token_budget():
    sizes = [30, 50, 20, 10, 120, 40, 60, 100, 1]
    batches = list(pack_by_token_budget([Item(n) for n in sizes], 100))
    assert [[i.n_tokens for i in b.items] for b in batches] == [[30, 50, 20], [10], [120], [40, 60], [100], [1]]
    assert [b.oversize for b in batches] == [False, False, True, False, False, False]
    assert all(b.n_tokens <= 100 or b.oversize for b in batches)
    with pytest.raises(ValueError, match="positive"):
        list(pack_by_token_budget([], 0))


def test_stream_packs_by_budget_and_picks_up_a_shard_written_while_reading(tmp_path):
    small_shard(tmp_path / "shard-000.h5", n=4, seed=1, prefix="a")
    (tmp_path / ".shard-002.h5.123.abcd.tmp").write_bytes(b"half a file")  # a writer still at work
    first_batch_seen = threading.Event()
    done = threading.Event()

    def producer():
        first_batch_seen.wait(timeout=30)
        small_shard(tmp_path / "shard-001.h5", n=5, seed=2, prefix="b")
        mark_end_of_stream(tmp_path)
        done.set()

    thread = threading.Thread(target=producer)
    thread.start()
    budget = 1200
    stream = ShardStream(tmp_path, budget, poll_s=0.02, idle_timeout_s=60)
    batches = []
    for batch in stream:
        if not batches:
            assert not (tmp_path / "shard-001.h5").exists()  # the second shard comes while reading
        batches.append(batch)
        first_batch_seen.set()
    thread.join()
    assert done.is_set()
    ids = [item.rollout_id for b in batches for item in b.items]
    assert ids == ["a0", "a1", "a2", "b0", "b1", "b2", "b3"]  # a3 and b4: failed evaluations
    assert all(b.n_tokens == sum(i.n_tokens for i in b.items) for b in batches)
    assert all(b.n_tokens <= budget or (b.oversize and len(b.items) == 1) for b in batches)
    assert stream.stats.rollouts_excluded == 2 and stream.excluded == []
    assert stream.stats.tokens == sum(b.n_tokens for b in batches)
    item = batches[0].items[0]
    assert item.loss_weight.dtype == np.float32 and item.loss_weight.shape == (item.tree.n_tokens,)


def test_corrupt_shard_is_recorded_and_skipped(tmp_path):
    good = small_shard(tmp_path / "shard-000.h5", n=3, prefix="a", failed_last=False)
    bad = shutil.copy(good, tmp_path / "shard-001.h5")
    os.truncate(bad, Path(bad).stat().st_size // 2)
    flipped = Path(shutil.copy(good, tmp_path / "shard-002.h5"))
    with h5py.File(flipped) as f:
        offset = f["tokens/loss_weight"].id.get_offset()
    flip_byte(flipped, offset + 2)
    small_shard(tmp_path / "shard-003.h5", n=2, prefix="c", failed_last=False)
    (tmp_path / END_OF_STREAM).touch()
    seen = []
    stream = ShardStream(tmp_path, 10_000, poll_s=0.01, on_excluded=seen.append)
    ids = [item.rollout_id for batch in stream for item in batch.items]
    assert ids == ["a0", "a1", "a2", "c0", "c1"]
    assert [Path(e.path).name for e in stream.excluded] == ["shard-001.h5", "shard-002.h5"]
    assert "truncated" in stream.excluded[0].reason and "/tokens/loss_weight: checksum" in stream.excluded[1].reason
    assert seen == stream.excluded
    assert [Path(p).name for p in stream.stats.shards_read] == ["shard-000.h5", "shard-003.h5"]


def test_stream_idle_timeout(tmp_path):
    with pytest.raises(StreamIdleTimeout, match="no new shard"):
        list(ShardStream(tmp_path / "not-yet-created", 100, poll_s=0.01, idle_timeout_s=0.1))


def test_stream_stop_callback(tmp_path):
    small_shard(tmp_path / "s.h5", n=2, failed_last=False)
    stream = ShardStream(tmp_path, 100_000, poll_s=0.01, stop=lambda: True)
    assert [len(b.items) for b in stream] == [2]


def test_empty_shard_round_trips(tmp_path):
    path = write_shard(tmp_path / "empty.h5", [], run_id="r", step=0)
    shard = read_shard(path)
    assert shard.n_rollouts == 0 and list(shard) == [] and shard.attrs["n_tokens"] == 0
