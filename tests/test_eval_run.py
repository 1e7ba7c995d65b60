"""Evaluation during a run, end to end through the real CLI at a toy size (scheduler=colocate)."""

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from gyre.eval.metrics import pass_at_k
from gyre.metrics import read_metrics
from gyre.pipeline import EVAL_EXCLUSION
from gyre.sched.controller.report import step_rows
from gyre.store.reader import read_shard

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "scheduler=colocate",  # the eval runs between a step's update and the next step's rollouts: one per version
    "tasks.families=[write_value]",  # one trained family; the held-out set adds echo_files, never trained on
    "rl.groups_per_step=2",
    "rl.group_size=2",
    "warm_start.steps=3",
    "warm_start.demos=16",
    "warm_start.batch_size=4",
    "tokenizer.corpus_tasks=60",
    "tokenizer.vocab_size=512",
    "harness.max_turns=3",
    "harness.max_tokens=24",
]


def run_eval_job(tmp_path: Path, *extra: str) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path / "run"
    args = [*TINY, "steps=2", "eval.every=1", "eval.max_tasks=2", "eval.samples=3", "eval.temperature=0",
            f"warm_start.cache_dir={tmp_path / 'cache'}", f"output_dir={out}", f"hydra.run.dir={tmp_path / 'h'}",
            *extra]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "launch.run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    return run_eval_job(tmp_path_factory.mktemp("eval_run"))


def test_run_with_eval_every_step_writes_eval_rows_and_shards_and_trains_none_of_them(eval_run):
    out, proc = eval_run
    rows = read_metrics(out / "metrics.jsonl")
    evals = [r for r in rows if r.get("event") == "eval"]
    assert [r["version"] for r in evals] == [0, 1, 2]  # before the first step, after each
    assert [r["step"] for r in step_rows(rows)] == [0, 1]
    for r in evals:
        assert r["n_tasks"] == 2 and r["n_samples"] == 6 and r["weight_versions"] == [str(r["version"])]
        assert set(r["per_family"]) == {"write_value", "echo_files"}  # echo_files: never trained on
        check_row_against_shards(out, r)
    assert "gyre: held-out pass@1" in proc.stdout

    eval_ids = {rid for r in evals for rid in shard_rollout_ids(out, r)}
    assert not eval_ids & {rid for p in (out / "shards").glob("*.h5") for rid in (x.rollout_id for x in read_shard(p))}
    state = json.loads((out / "checkpoint" / "state.json").read_text())  # the ledger of every step's rollouts
    ledger = json.dumps(state)
    assert '"s0-g0-r0"' in ledger and not any(f'"{rid}"' in ledger for rid in eval_ids)
    calls = [json.loads(line) for line in (out / "calls.jsonl").read_text().splitlines()]
    eval_calls = [c for c in calls if c["rollout_id"].startswith("e")]
    assert eval_calls and {c["temperature"] for c in eval_calls} == {0.0}  # greedy: launch.eval repeats it
    assert (out / "learning_curve.png").stat().st_size > 1000
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["held_out_pass@1"]) == {"0", "1", "2"}


def shard_rollout_ids(out: Path, row: dict) -> list[str]:
    return [x.rollout_id for name in row["shards"] for x in read_shard(out / "shards_eval" / name)]


def check_row_against_shards(out: Path, row: dict, samples: int = 3) -> None:
    """pass@k recomputed from the eval shards alone; every eval rollout excluded, no loss weight."""
    per_task: dict[str, list[float]] = defaultdict(list)
    for name in row["shards"]:
        for x in read_shard(out / "shards_eval" / name):
            assert x.meta.exclusion_reason.startswith(EVAL_EXCLUSION)
            assert x.meta.advantage is None and x.meta.reward is None
            assert not np.any(x.loss_weight)
            if x.meta.score is not None:
                per_task[x.meta.task_id].append(x.meta.score)
    assert len(row["shards"]) == row["n_tasks"]
    for k in range(1, samples + 1):
        values = [pass_at_k(len(s), sum(v == 1.0 for v in s), k) for s in per_task.values() if len(s) >= k]
        expected = sum(values) / len(values) if values else None
        assert row[f"pass@{k}"] == pytest.approx(expected)
    scores = [v for s in per_task.values() for v in s]
    assert row["mean_reward"] == pytest.approx(sum(scores) / len(scores))


def test_launch_eval_on_a_checkpoint_repeats_the_in_run_eval_of_its_version(eval_run, tmp_path):
    run, _ = eval_run
    out = tmp_path / "eval"
    args = [*TINY, "eval.max_tasks=2", "eval.samples=3", "eval.temperature=0", f"eval.checkpoint={run / 'checkpoint'}",
            f"warm_start.cache_dir={run.parent / 'cache'}", f"output_dir={out}", f"hydra.run.dir={tmp_path / 'h'}"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "launch.eval", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gyre eval: weight version 2: pass@1" in proc.stdout
    (row,) = [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "eval"]
    in_run = next(r for r in read_metrics(run / "metrics.jsonl") if r.get("event") == "eval" and r["version"] == 2)
    assert row["version"] == 2 and row["weight_versions"] == ["2"]
    for key in ("n_tasks", "n_samples", "excluded", "pass@1", "pass@2", "pass@3", "mean_reward"):
        assert row[key] == in_run[key], key
    check_row_against_shards(out, row)
    table = json.loads((out / row["task_table"]).with_suffix(".json").read_text())
    assert sum(t["samples"] for t in table) == 6 and (out / row["task_table"]).exists()
    assert not list((out / "shards").glob("*.h5"))  # nothing trained
