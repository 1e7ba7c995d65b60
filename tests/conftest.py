"""Shared fixtures. Tests marked `slurm` get a real local Slurm cluster (slurm/cluster.sh: slurmctld,
3 slurmd, munge), started once per session and stopped at its end. Without Slurm they fail.

Two cluster modes (slurm/cluster.sh --hosts): `loopback`, every node on 127.0.0.1, and `netns`, each
node its own host (network namespace, address, hostname, /etc/hosts). A test runs on `loopback`
unless it takes the `slurm_hosts` argument, parametrized with `SLURM_HOST_MODES` (or a subset); each
mode's cluster starts on first use. GYRE_SLURM_HOSTS=loopback (comma-separated) limits the modes run."""

from __future__ import annotations

import contextlib
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
# For a test that asserts every cell trains in every step: a step trains nothing when each of its groups got one
# reward throughout (no advantage). At this workload's reward rate (about 1 rollout in 5 earns any) a group of 8
# does so about 1 time in 6, so 2 groups leave a step untrained about 1 time in 35 (seen on a fresh clone);
# 4 groups about 1 time in 1,000
EVERY_STEP_TRAINS = ["rl.groups_per_step=4"]


SLURM_HOST_MODES = ("loopback", "netns")


def slurm_host_modes(*modes: str) -> list:
    """pytest params for `slurm_hosts`: `modes` (default: both), those left out by GYRE_SLURM_HOSTS skipped."""
    wanted = os.environ.get("GYRE_SLURM_HOSTS", ",".join(SLURM_HOST_MODES)).split(",")
    skip = pytest.mark.skip(reason="GYRE_SLURM_HOSTS leaves this cluster mode out")
    return [pytest.param(m, marks=[] if m in wanted else [skip], id=m) for m in modes or SLURM_HOST_MODES]


def start_slurm_cluster(nodes: int = 3, hosts: str = "loopback") -> Path:
    """Start a cluster in a fresh directory; returns its slurm.conf. Fails the test on any problem."""
    state_dir = Path(tempfile.mkdtemp(prefix="gyre-slurm-test-"))
    state_dir.chmod(0o755)  # munged runs as the munge user and must reach its socket inside
    proc = subprocess.run(
        ["bash", str(CLUSTER_SH), "start", "--dir", str(state_dir), "--nodes", str(nodes), "--hosts", hosts],
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
def slurm_clusters() -> Iterator[dict[str, Path]]:
    """mode -> slurm.conf of the clusters started so far (by `_slurm_cluster_for_marked_tests`)."""
    started: dict[str, Path] = {}
    try:
        yield started
    finally:
        for conf in started.values():
            stop_slurm_cluster(conf)


@pytest.fixture
def slurm_hosts(request: pytest.FixtureRequest) -> str:
    """The cluster mode a test runs on (parametrize it with slurm_host_modes())."""
    return getattr(request, "param", "loopback")


@pytest.fixture(autouse=True)
def _slurm_cluster_for_marked_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if not request.node.get_closest_marker("slurm"):
        return
    callspec = getattr(request.node, "callspec", None)
    mode = callspec.params.get("slurm_hosts", "loopback") if callspec else "loopback"
    started = request.getfixturevalue("slurm_clusters")
    if mode not in started:
        started[mode] = start_slurm_cluster(hosts=mode)
    monkeypatch.setenv("SLURM_CONF", str(started[mode]))  # subprocesses (sbatch, submitit, hydra) find it


@pytest.fixture
def slurm_conf(_slurm_cluster_for_marked_tests: None) -> Path:
    return Path(os.environ["SLURM_CONF"])


# tests/data holds task suites whose own tests (a Harbor task's tests/test_outputs.py) are the tasks', run by
# their graders inside sandboxes, never by this suite
collect_ignore = ["data"]


@contextlib.contextmanager
def fake_sglang_server(directory: Path) -> Iterator[tuple[str, Path]]:
    """tests/fake_sglang_server.py on a free loopback port: (its URL, the file recording its requests)."""
    import socket
    import sys
    import time

    from gyre.engine.client import SyncEngineClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    record = directory / f"requests-{port}.jsonl"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, str(root / "tests" / "fake_sglang_server.py"), str(port), str(record)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while not SyncEngineClient(url, timeout_s=2).health():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.2)
        yield url, record
    finally:
        try:
            SyncEngineClient(url, timeout_s=5).post("/shutdown")
        except Exception:  # noqa: BLE001 - it exits while answering
            pass
        proc.wait(30)


@pytest.fixture
def fake_sglang(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A server answering SGLang's routes and receiving weight broadcasts with SGLang's own code."""
    with fake_sglang_server(tmp_path) as server:
        yield server


@pytest.fixture
def fake_sglang_pair(tmp_path: Path) -> Iterator[list[tuple[str, Path]]]:
    with fake_sglang_server(tmp_path) as first, fake_sglang_server(tmp_path) as second:
        yield [first, second]
