"""Shared fixtures. Tests marked `slurm` get a real local Slurm cluster (slurm/cluster.sh: slurmctld,
3 slurmd, munge), started once per session and stopped at its end. Without Slurm they fail."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

CLUSTER_SH = Path(__file__).resolve().parents[1] / "slurm" / "cluster.sh"
# A small cell-job run: 2 steps of 2 groups of 8 sessions on cells of 4 sessions each
CELL_WORKLOAD = [
    "steps=2",
    "rl.groups_per_step=2",
    "rl.group_size=8",
    "harness.max_turns=4",
    "harness.temperature=1.6",  # the warm start is near-deterministic at 1.0: no reward spread, nothing to train
    "sched.capacity_per_cell=4",
]


def start_slurm_cluster(nodes: int = 3) -> Path:
    """Start a cluster in a fresh directory; returns its slurm.conf. Fails the test on any problem."""
    state_dir = Path(tempfile.mkdtemp(prefix="gyre-slurm-test-"))
    state_dir.chmod(0o755)  # munged runs as the munge user and must reach its socket inside
    proc = subprocess.run(
        ["bash", str(CLUSTER_SH), "start", "--dir", str(state_dir), "--nodes", str(nodes)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        pytest.fail(f"the local Slurm cluster did not start (slurm/cluster.sh):\n{proc.stderr}", pytrace=False)
    return state_dir / "slurm.conf"


def stop_slurm_cluster(conf: Path) -> None:
    proc = subprocess.run(
        ["bash", str(CLUSTER_SH), "stop", "--dir", str(conf.parent)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    shutil.rmtree(conf.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_conf() -> Iterator[Path]:
    conf = start_slurm_cluster()
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)  # subprocesses (sbatch, submitit, hydra) find the cluster
    try:
        yield conf
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        stop_slurm_cluster(conf)


@pytest.fixture(autouse=True)
def _slurm_cluster_for_marked_tests(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("slurm"):
        request.getfixturevalue("slurm_conf")
