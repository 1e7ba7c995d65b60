"""The main job end to end, through the real CLI, at a toy size."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tracking_readers import check_step_rows_in_trackers, tensorboard_tags

from gyre.metrics import read_metrics
from gyre.sched.controller.report import step_rows
from gyre.store.reader import read_shard

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
REQUIRED = {"step", "reward_mean", "success_rate", "n_rollouts", "wall_s"}


def test_main_job_runs_end_to_end(tmp_path):
    out = tmp_path / "run"
    args = [
        "steps=2",  # first: the second run drops it
        "scheduler=colocate",  # the one-process loop (the default, elastic, is tests/test_elastic_run.py's)
        "rl.groups_per_step=2",
        "rl.group_size=2",
        "warm_start.steps=3",
        "warm_start.demos=16",
        "warm_start.batch_size=4",
        "tokenizer.corpus_tasks=60",
        "tokenizer.vocab_size=512",
        "harness.max_turns=3",
        "harness.max_tokens=24",
        "harness.temperature=0.7",  # trained as sampled: behaviour and training logprobs at T=0.7
        f"warm_start.cache_dir={tmp_path / 'cache'}",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wb")}
    proc = subprocess.run([sys.executable, "-m", "launch.run", *args, "logger=[tensorboard,wandb]"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"gyre: outputs in {out}" in proc.stdout
    rows = step_rows(read_metrics(out / "metrics.jsonl"))  # beside the controller's events
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert REQUIRED <= set(r)
        assert r["n_rollouts"] == 4
        assert 0.0 <= r["success_rate"] <= 1.0
    assert (out / "learning_curve.png").stat().st_size > 1000
    check_trackers(out, rows)
    assert (out / "checkpoint" / "trainer" / ".metadata").exists()
    calls = [json.loads(line) for line in (out / "calls.jsonl").read_text().splitlines()]
    assert calls and all(len(c["output_ids"]) == len(c["output_logprobs"]) for c in calls)
    assert {c["temperature"] for c in calls} == {0.7}

    # every rollout of every step is in exactly one group shard, as a tree holding all its calls
    shards = sorted((out / "shards").glob("*.h5"))
    assert [p.name for p in shards] == [f"step{s:05d}-group{g:04d}.h5" for s in (0, 1) for g in (0, 1)]
    stored = [r for p in shards for r in read_shard(p)]
    assert sorted(r.rollout_id for r in stored) == sorted(
        f"s{s}-g{g}-r{i}" for s in (0, 1) for g in (0, 1) for i in (0, 1)
    )
    recorded = {c["rollout_id"] for c in calls}
    for r in stored:
        assert r.rollout_id in recorded and r.tree.calls and r.tree.policy.any()
        assert {c.temperature for c in r.tree.calls} == {0.7}
        assert r.meta.excluded or abs(float(r.loss_weight.sum()) - 1.0) < 1e-5

    # a second run reuses the cached warm start
    again = subprocess.run(
        [sys.executable, "-m", "launch.run", *args[1:-2], f"output_dir={tmp_path / 'run2'}",
         f"hydra.run.dir={tmp_path / 'hydra2'}", "steps=1"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "reusing cached warm start" in again.stdout


def check_trackers(out: Path, rows: list[dict]) -> None:
    """logger=[tensorboard,wandb]: every numeric metric of every step row, read back by each tracker's reader,
    in one run named by the job's overrides."""
    (tb_dir,) = (out / "tensorboard").iterdir()
    assert "logger=" in tb_dir.name and "steps=2" in tb_dir.name and "output_dir" not in tb_dir.name
    assert check_step_rows_in_trackers(tb_dir, out / "wandb", rows) == tb_dir.name
    assert sorted(tensorboard_tags(tb_dir)["images"]) == ["learning_curve", "timeline"]


def test_a_step_of_excluded_rollouts_stops_the_run(tmp_path):
    """The proxy times out on every engine call (an infrastructure failure): every rollout is excluded, and
    the first such step stops the run (rl.max_excluded_steps=1) naming the reason and how often it came."""
    out = tmp_path / "run"
    args = [
        "scheduler=colocate", "steps=3", "rl.groups_per_step=1", "rl.group_size=2", "warm_start.enabled=false",
        "tokenizer.corpus_tasks=60", "tokenizer.vocab_size=512", "harness.max_turns=2", "harness.max_tokens=8",
        "proxy.request_timeout_s=0.001", f"warm_start.cache_dir={tmp_path / 'cache'}", f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "launch.run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "stopping: 1 step(s) in a row (0)" in proc.stderr and "(2 of 2)" in proc.stderr, proc.stderr[-3000:]
    assert "2x infrastructure: proxy answered HTTP N" in proc.stderr, proc.stderr[-3000:]
    rows = step_rows(read_metrics(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0] and rows[0]["n_excluded"] == 2
    assert rows[0]["excluded_reason_counts"][0][1] == 2
