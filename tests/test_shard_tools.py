"""The offline shard tools, run as subprocesses the way a user runs them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gyre.store import read_shard
from gyre.traj.tree import ROLES
from tools.export_tree import tree_from_json
from tools.plot_tree import branch_heads, layout

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration
N_ROLLOUTS = 6  # synthetic_shard: rollout 4 timed out, rollout 5's evaluation failed


def tool(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("shards")
    for step in (0, 1):
        tool(
            "tools.synthetic_shard",
            str(d / f"step{step}.h5"),
            "--rollouts",
            str(N_ROLLOUTS),
            "--tokens",
            "3000",
            "--calls",
            "14",
            "--seed",
            str(step),
            "--step",
            str(step),
        )
    return d


def test_summary_json(shards, tmp_path):
    d = Path(shutil.copytree(shards, tmp_path / "d"))
    bad = d / "step9.h5"
    bad.write_bytes((d / "step0.h5").read_bytes()[:5000])  # a half-copied shard
    proc = tool("tools.shard_summary", str(d), "--json", check=False)
    assert proc.returncode == 1, proc.stderr  # an unreadable shard is reported, not fatal
    s = json.loads(proc.stdout)

    shard_list = [read_shard(d / f"step{k}.h5") for k in (0, 1)]
    rollouts = [r for shard in shard_list for r in shard]
    tree_tokens = sum(r.tree.n_tokens for r in rollouts)
    expanded = sum(int((r.tree.depth[r.tree.leaves()] + 1).sum()) for r in rollouts)  # path by path
    assert s["steps"] == [0, 1] and len(s["shards"]) == 2
    assert [u["path"] for u in s["unreadable_shards"]] == [str(bad)]
    assert s["rollouts"]["total"] == 2 * N_ROLLOUTS
    assert s["rollouts"]["grade_status"] == {"ok": 8, "timeout": 2, "failed": 2, "agent_failed": 0}
    assert s["rollouts"]["timeouts"] == 2 and s["rollouts"]["excluded"] == 2 and s["rollouts"]["trained"] == 10
    assert s["rollouts"]["exclusion_reasons"] == {"checker exited with code 1: workspace missing": 2}
    assert s["tokens"]["tree"] == tree_tokens and s["tokens"]["expanded"] == expanded
    ratio = s["tokens"]["path_tokens_per_tree_token"]
    assert ratio == pytest.approx(expanded / tree_tokens) and ratio > 1.2
    assert sum(v["context"] + v["policy"] for v in s["tokens"]["by_role"].values()) == tree_tokens
    assert s["calls"]["total"] == sum(len(r.tree.calls) for r in rollouts) == sum(s["calls"]["by_role"].values())
    assert s["calls"]["excluded"] == sum(1 for r in rollouts for c in r.tree.calls if c.excluded)
    assert set(s["calls"]["by_role"]) == set(ROLES) and s["calls"]["by_role"]["side"] == 2 * N_ROLLOUTS
    rewards = [r.meta.reward for r in rollouts if not r.meta.excluded]
    assert s["reward"]["n"] == 10 and s["reward"]["mean"] == pytest.approx(np.mean(rewards), rel=1e-6)
    assert sum(s["reward_histogram"]["counts"]) == 10


def test_summary_text_and_png(shards, tmp_path):
    png = tmp_path / "summary.png"
    out = tool("tools.shard_summary", str(shards / "step0.h5"), "--png", str(png)).stdout
    assert "rollouts: 6 in 1 groups; trained 5, excluded 1; ok 4, timeout 1, failed 1" in out
    assert "path tokens per tree token" in out and "timeouts: 1" in out and "excluded evaluations: 1" in out
    assert "checker exited with code 1" in out and "excluded calls:" in out
    assert_png(png)


def test_summary_of_an_empty_directory(tmp_path):
    proc = tool("tools.shard_summary", str(tmp_path), check=False)
    assert proc.returncode == 2 and "no shards" in proc.stderr


def test_export_tree_round_trips(shards, tmp_path):
    out = tmp_path / "tree.json"
    tool("tools.export_tree", str(shards / "step1.h5"), "--rollout", "s1-r2", "--out", str(out))
    doc = json.loads(out.read_text())
    tree, weight = tree_from_json(doc)
    stored = read_shard(shards / "step1.h5")
    original = stored.rollout(stored.index_of("s1-r2"))
    for name in ("tokens", "parent", "depth", "policy", "logprob", "call_id", "role"):
        np.testing.assert_array_equal(getattr(tree, name), getattr(original.tree, name), err_msg=name)
    np.testing.assert_array_equal(weight, original.loss_weight)
    assert tree.calls == original.tree.calls and doc["meta"]["reward"] == pytest.approx(original.meta.reward)
    assert doc["n_paths"] == original.tree.leaves().size
    stdout = tool("tools.export_tree", str(shards / "step1.h5"), "--index", "5").stdout
    assert json.loads(stdout)["meta"]["exclusion_reason"]
    missing = tool("tools.export_tree", str(shards / "step1.h5"), "--rollout", "nope", check=False)
    assert missing.returncode == 1 and "'nope' is not in" in missing.stderr
    absent = tool("tools.export_tree", str(shards / "step9.h5"), check=False)
    assert absent.returncode == 1 and absent.stderr == f"export_tree: cannot read {shards / 'step9.h5'}: no such file\n"
    not_a_run = tool("tools.check_trained_tokens", str(shards), check=False)  # shards, not a run's directory
    assert not_a_run.returncode == 2 and "is not a run's output directory" in not_a_run.stderr
    assert "Traceback" not in not_a_run.stderr


def test_plot_tree(shards, tmp_path):
    png = tmp_path / "tree.png"
    tool("tools.plot_tree", str(shards / "step0.h5"), "--rollout", "s0-r0", "--out", str(png))
    assert_png(png)
    broken = tmp_path / "broken.h5"
    broken.write_bytes(b"\x89HDF\r\n\x1a\n" + os.urandom(64))
    proc = tool("tools.plot_tree", str(broken), "--out", str(tmp_path / "x.png"), check=False)
    assert proc.returncode == 1 and "ShardError" not in proc.stderr and "cannot be opened as HDF5" in proc.stderr


def test_plot_layout_follows_branches():
    from test_store import hand_tree

    tree = hand_tree()
    np.testing.assert_array_equal(branch_heads(tree), [0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 10, 10])
    runs, row, connectors = layout(tree)
    assert row == {0: 0, 4: 1, 10: 2}
    assert connectors == [(4, 0, 1), (4, 0, 2)]
    policy_runs = sorted((r.x0, r.x1, r.row) for r in runs if r.policy)
    assert policy_runs == [(4, 6, 1), (5, 6, 2), (8, 10, 1)]


def test_bench_script_runs(tmp_path):
    """Smoke test only (no timing assertions): the benchmark's figures are reported, not tested."""
    proc = tool(
        "tools.bench_hdf5",
        "--tokens",
        "20000",
        "--calls",
        "20",
        "--repeats",
        "1",
        "--small-rollout-tokens",
        "4000",
        "--budget",
        "9000",
        "--dir",
        str(tmp_path),
        "--json",
    )
    result = json.loads(proc.stdout)
    assert result["tree"]["tokens"] >= 20000 and result["stream_one_big_tree"]["micro_batches"] == 1
    assert result["stream_many_rollouts"]["micro_batches"] >= 2
    assert os.listdir(tmp_path) == []


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
