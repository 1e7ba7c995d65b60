"""Experiment trackers (`logger=tensorboard|wandb`): the rows of metrics.jsonl, read back with each
tracker's own reader (tests/tracking_readers.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tracking_readers import tensorboard_scalars, tensorboard_tags, wandb_run

from gyre.config.load import compose
from gyre.config.validate import ConfigValueError
from gyre.metrics import MetricsWriter, plot_learning_curve, read_metrics
from gyre.tracking import open_trackers

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]

ROWS = [
    {"step": 0, "reward_mean": 0.25, "success_rate": 0.0, "train/loss": 1.5, "n_rollouts": 4, "excluded_reasons": []},
    {"event": "switch", "cell": 1, "direction": "rollout->train", "latency_s": 0.75, "initial": False},
    {"step": 1, "reward_mean": 0.5, "success_rate": 0.5, "train/loss": 1.25, "n_rollouts": 4, "excluded_reasons": []},
    {"event": "switch", "cell": 1, "direction": "train->rollout", "latency_s": 0.5, "initial": False},
    {"event": "summary", "steps": 2, "switch_median_s": {"rollout->train": 0.75}},
]


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))


def test_every_metric_reaches_tensorboard_and_wandb(tmp_path, offline_wandb):
    cfg = compose(["logger=[jsonl,tensorboard,wandb]", "tracking.run_name=lr-3e-6"])
    writer = MetricsWriter(tmp_path, open_trackers(cfg, tmp_path))
    for row in ROWS:
        writer.write(row)
    writer.image("learning_curve", plot_learning_curve([r for r in ROWS if "step" in r], tmp_path / "curve.png"))
    writer.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")  # still the source of truth, unchanged
    assert rows == [json.loads(json.dumps(r, sort_keys=True)) for r in ROWS]
    steps = [r for r in rows if "step" in r and "event" not in r]

    tb = tensorboard_scalars(tmp_path / "tensorboard" / "lr-3e-6")
    for r in steps:
        for key in ("reward_mean", "success_rate", "train/loss", "n_rollouts"):
            assert tb[key][r["step"]] == pytest.approx(r[key])
    assert tb["events/switch/latency_s"] == {0: 0.75, 1: 0.5} and tb["events/switch/initial"] == {0: 0.0, 1: 0.0}
    tags = tensorboard_tags(tmp_path / "tensorboard" / "lr-3e-6")
    assert tags["images"] == ["learning_curve"]

    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    name, history, summary = wandb_run(run_dir)
    assert name == "lr-3e-6"
    by_step = {h["step"]: h for h in history if "reward_mean" in h}
    for r in steps:
        for key in ("reward_mean", "success_rate", "train/loss", "n_rollouts"):
            assert by_step[r["step"]][key] == pytest.approx(r[key])
    switches = [h for h in history if "events/switch/latency_s" in h]
    assert [(h["events/switch/index"], h["events/switch/latency_s"]) for h in switches] == [(0, 0.75), (1, 0.5)]
    assert summary["summary/steps"] == 2 and summary["summary/switch_median_s/rollout->train"] == 0.75
    assert any(k.startswith("learning_curve/") for h in history for k in h)
    assert not os.environ.get("WANDB_API_KEY")


def test_logger_takes_one_name_or_a_list_and_rejects_unknown_ones():
    assert compose(["logger=tensorboard"]).logger == ["tensorboard"]
    assert compose(["logger=[tensorboard,wandb]"]).logger == ["tensorboard", "wandb"]
    assert compose([]).logger == ["jsonl"]
    with pytest.raises(ConfigValueError, match=r"unknown \['mlflow'\]"):
        compose(["logger=mlflow"])
    with pytest.raises(ConfigValueError, match="wandb_mode"):
        compose(["tracking.wandb_mode=cloud"])


def test_jsonl_alone_opens_no_tracker(tmp_path):
    assert open_trackers(compose([]), tmp_path) == []
    assert not list(Path(tmp_path).iterdir())


LEAVE_LIKE_A_RANK = """
import os, sys
import wandb
from gyre.tracking import remove_wandb_temporary_dirs
if sys.argv[1] == "remove":
    remove_wandb_temporary_dirs()
os._exit(0)  # as gyre.sched.launch.job.leave does: no atexit hooks
"""


@pytest.mark.parametrize("remove", [False, True])
def test_a_process_that_leaves_with_os_exit_removes_wandbs_temporary_dirs(tmp_path, remove):
    """wandb makes tmp*wandb-media and tmp*wandb-artifacts in TMPDIR at import and removes them in atexit hooks,
    which os._exit skips: left behind unless removed first (gyre.sched.launch.job.exit_now)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "PYTHONPATH": str(ROOT)}  # fmt: skip
    argv = [sys.executable, "-c", LEAVE_LIKE_A_RANK, "remove" if remove else "keep"]
    subprocess.run(argv, check=True, env=env, timeout=120)
    left = sorted(p.name[p.name.index("wandb-") :] for p in tmp.glob("tmp*wandb-*"))
    assert left == ([] if remove else ["wandb-artifacts", "wandb-media"])
