"""Real jobs on the local Slurm cluster of slurm/cluster.sh (3 nodes; started by tests/conftest.py)."""

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import cloudpickle
import pytest
from conftest import start_slurm_cluster, stop_slurm_cluster
from omegaconf import OmegaConf

from gyre.config.load import compose
from gyre.config.schema import RunConfig
from launch.slurm.het_executor import ACTIVE, HetSlurmExecutor, het_job_state
from launch.slurm.plan import plan_step
from launch.slurm.sbatch import ScriptLayout, render_sbatch
from launch.submit import main as submit_main

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[1]
PROBE = [sys.executable, "-m", "gyre.sched.launch.slurm_env"]
LINE = re.compile(r"rank=(\d+) cell=(\d+) role=(\w+) local_rank=(\d+) .* node=(\w+)")


def _cpu_cfg() -> RunConfig:
    return compose(["cluster=slurm_cpu", f"cluster.python={sys.executable}", f"cluster.workdir={ROOT}"])


def _wait_for_end(job_id: str, timeout_s: float = 60) -> str:
    """The final state of a het job (`sbatch --wait` polls at growing intervals, seconds each)."""
    deadline = time.monotonic() + timeout_s
    while (state := het_job_state(job_id)) in ACTIVE and time.monotonic() < deadline:
        time.sleep(0.1)
    return state


def _ranks(text: str) -> list[tuple[int, int, str, str]]:
    return [(int(m[1]), int(m[2]), m[3], m[5]) for m in LINE.finditer(text)]


def _run_cell_job(tmp_path: Path, argv: list[str], held: Callable[[str], None] | None = None) -> tuple[str, str]:
    """The slurm_cpu cell job's script with `argv` as each rank's command, submitted and waited for: (job, state).
    `held`: called with the job's id while the job is held, before it may start."""
    cfg = _cpu_cfg()
    script = tmp_path / "job.sbatch"
    script.write_text(
        render_sbatch(cfg, plan_step(cfg, argv), ScriptLayout(log_dir=str(tmp_path), config_path="(test)"))
    )
    hold = ["--hold"] if held else []
    proc = subprocess.run(["sbatch", "--parsable", *hold, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    if held:
        try:
            held(job)
        finally:
            subprocess.run(["scontrol", "release", job], check=True, timeout=30)
    return job, _wait_for_end(job)


def test_het_job_across_three_nodes_gives_each_rank_its_cell(tmp_path):
    job, state = _run_cell_job(tmp_path, PROBE)
    assert state == "COMPLETED", state + "".join(p.read_text() for p in tmp_path.glob("*batch.out"))
    ranks = sorted(r for p in tmp_path.glob(f"{job}_cells_*.out") for r in _ranks(p.read_text()))
    # the controller (rank 0) and the core cell share component 0; then one rank per satellite
    assert [r[:3] for r in ranks] == [(0, 0, "core"), (1, 0, "core"), (2, 1, "satellite"), (3, 2, "satellite")]
    assert ranks[0][3] == ranks[1][3] and len({r[3] for r in ranks}) == 3  # one component per node


MPI_PROBE = [
    sys.executable,
    "-c",
    "from mpi4py import MPI; w = MPI.COMM_WORLD; print(f'world {w.size} sum {w.allreduce(1)}')",
]
PMI_REQUEST = re.compile(r"send to fd=\d+ pmi: (cmd=.*)")
PMI_VALLEN = re.compile(r"got pmi response: cmd=maxes .*vallen_max=(\d+)")


def test_the_cell_jobs_mpi_world_starts_through_slurms_pmi_in_requests_it_reads_whole(tmp_path, monkeypatch):
    """Slurm reads a PMI-1 request with one read() of 1,024 bytes; MPICH cuts values into segments of
    (vallen_max - 2) / 2 bytes, hex-encoded, and its ucx module publishes 4 KB of mostly stray heap bytes: with
    Slurm's vallen_max=1024 a segment that does not compress made a ~1,080-byte request and a CI run's world never
    came up (gyre/sched/launch/pmi_relay.py). In the script's MPI world (PMI_DEBUG: MPICH prints each request and
    reply) every put would fit that read whatever its bytes, and every request does."""
    monkeypatch.setenv("PMI_DEBUG", "1")  # sbatch --export=ALL: the ranks' MPICH prints its PMI requests
    job, state = _run_cell_job(tmp_path, MPI_PROBE)
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob(f"{job}_cells_*.out")))
    assert state == "COMPLETED", logs[-3000:]
    assert logs.count("world 4 sum 4") == 4, logs[-3000:]
    (vallen,) = {int(v) for v in PMI_VALLEN.findall(logs)}  # what every rank was told
    requests = PMI_REQUEST.findall(logs)
    puts = [r for r in requests if r.startswith("cmd=put ") and "-seg-" in r]
    assert puts, requests  # the ucx address went out in segments
    # the longest a segment's request can be: its command, (vallen - 2) / 2 bytes as hex, a newline
    worst = max(len(r[: r.index(" value=") + len(" value=")]) + 2 * ((vallen - 2) // 2) + 1 for r in puts)
    assert worst <= 1024, f"vallen_max={vallen}: a put of {worst} bytes would be cut by Slurm's read"
    assert max(len(r) + 1 for r in requests) <= 1024


def _fnv1a(text: str) -> int:
    """The 32-bit FNV-1a hash MPICH names a world's shared memory by (HASH_FNV of src/mpl/include/uthash.h)."""
    h = 2166136261
    for byte in text.encode():
        h = ((h ^ byte) * 16777619) & 0xFFFFFFFF
    return h


def test_a_world_never_opens_the_shared_memory_a_dead_world_of_its_name_left(tmp_path):
    """MPICH names the shared memory a node's ranks meet in after the kvsname (/dev/shm/mpich_shm_<FNV-1a>_<node>),
    and Slurm's kvsname, JOBID.STEPID, comes again after a requeue and on a new cluster: a world that died leaves
    its segments, and one sized for fewer ranks failed all three starts of a later world of that name
    ("MPIDI_POSIX_comm_bootstrap: Out of memory"). With such segments under every name this job's starts would
    have had, its world comes up at the first start (gyre/sched/launch/pmi_relay.py: the start's own kvsname)."""
    planted = []

    def plant(job: str) -> None:
        for step in range(3):  # the script's three starts are steps 0, 1 and 2
            for node in range(3):
                path = Path(f"/dev/shm/mpich_shm_{_fnv1a(f'{job}.{step}'):x}_{node}")
                path.write_bytes(b"\1" * 4096)  # a dead world's: ready, and smaller than two ranks need
                planted.append(path)

    try:
        job, state = _run_cell_job(tmp_path, MPI_PROBE, held=plant)
        logs = "".join(p.read_text() for p in sorted(tmp_path.glob(f"{job}_*.out")))
        assert state == "COMPLETED" and logs.count("world 4 sum 4") == 4, logs[-3000:]
        assert "did not come up" not in logs and all(p.read_bytes() == b"\1" * 4096 for p in planted)
    finally:
        for path in planted:
            path.unlink(missing_ok=True)


def _where() -> tuple[int, int, str]:
    from gyre.sched.launch.slurm_env import cell_rank_from_env

    rank = cell_rank_from_env(os.environ)
    return rank.rank, rank.cell, rank.role


def _fail() -> None:
    raise ValueError("raised inside the het job")


def test_submitit_handle_returns_every_control_task_result(tmp_path):
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the nodes cannot import this test module
    executor = HetSlurmExecutor(tmp_path / "jobs", _cpu_cfg())
    job = executor.submit(_where)
    assert job.results() == [(0, 0, "core"), (1, 0, "core"), (2, 1, "satellite"), (3, 2, "satellite")]
    assert "Job completed successfully" in (job.stderr() or "") + (job.stdout() or "")
    assert _wait_for_end(job.job_id) == "COMPLETED"
    failing = executor.submit(_fail)
    with pytest.raises(Exception, match="raised inside the het job"):
        failing.results()
    with pytest.raises(ValueError, match="%j"):
        HetSlurmExecutor(tmp_path / "%j", _cpu_cfg())


def _sweep(app: str, sweep: Path, minutes: int, overrides: list[str], timeout_s: int) -> subprocess.CompletedProcess:
    """`python -m <app> -m hydra/launcher=submitit_slurm ...` on the local cluster's batch partition."""
    launcher = ["hydra/launcher=submitit_slurm", "hydra.launcher.partition=batch", "hydra.launcher.mem_gb=1"]
    launcher += [f"hydra.launcher.timeout_min={minutes}", f"hydra.sweep.dir={sweep}"]
    cmd = [sys.executable, "-m", app, "-m", *launcher, *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def test_hydra_multirun_sweep_of_the_main_job_through_submitit_launcher(tmp_path):
    """Two real runs of the embedded main job (one small RL step each), as a Slurm array."""
    sweep = tmp_path / "sweep"
    # each array task is a one-task allocation: the one-cell scheduler (the elastic default starts an MPI job)
    small = [
        "scheduler=colocate",
        "seed=1,2",
        "steps=1",
        "rl.groups_per_step=1",
        "rl.group_size=4",
        "harness.max_turns=2",
    ]
    proc = _sweep("launch.run", sweep, 10, small, 600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    runs = sorted(p.parent for p in sweep.glob("*/metrics.jsonl"))
    assert [r.name for r in runs] == ["0", "1"]  # each run in its own output directory
    seeds = []
    for run in runs:
        steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in steps if r.get("event", "step") == "step" and "reward_mean" in r] == [0]
        assert (run / "checkpoint" / "trainer" / ".metadata").stat().st_size > 0
        assert len(list((run / "shards").glob("step*-group*.h5"))) == 1
        seeds.append(int(OmegaConf.load(run / "config.yaml").seed))
    assert sorted(seeds) == [1, 2]


def test_hydra_multirun_sweep_through_submitit_launcher(tmp_path):
    sweep = tmp_path / "sweep"
    proc = _sweep("launch.probe", sweep, 5, ["scheduler=elastic,colocate", "seed=3"], 120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/probe.json"))]
    assert sorted(r["scheduler"] for r in reports) == ["colocate", "elastic"]
    assert len({r["output_dir"] for r in reports}) == 2 and all(r["seed"] == 3 and r["slurm_job_id"] for r in reports)


def _queued_job_ids() -> set[str]:
    queue = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30)
    assert queue.returncode == 0, queue.stderr
    return set(queue.stdout.split())


def test_unknown_partition_and_impossible_request_are_refused_with_a_hint(tmp_path):
    before = _queued_job_ids()  # an earlier test's job may still be ending
    with pytest.raises(SystemExit, match=r"cluster.core.partition='gpu'.*it has: batch, debug"):
        submit_main(["--via", "sbatch", "--out", str(tmp_path), "cluster=slurm_cpu", "cluster.core.partition=gpu"])
    with pytest.raises(SystemExit, match=r"cluster.satellites.0 asks for 1 node.*64 CPUs.*largest node has 4 CPUs"):
        submit_main(
            ["--via", "sbatch", "--out", str(tmp_path), "cluster=slurm_cpu", "cluster.satellites.0.cpus_per_node=64"]
        )
    assert _queued_job_ids() <= before  # nothing was submitted


def test_het_job_on_a_single_node_cluster_is_refused_before_submitting(tmp_path, monkeypatch):
    conf = start_slurm_cluster(nodes=1)
    try:
        monkeypatch.setenv("SLURM_CONF", str(conf))
        with pytest.raises(SystemExit, match=r"needs 3 distinct nodes.*single node \(node1\)"):
            submit_main(["--via", "sbatch", "--out", str(tmp_path), "cluster=slurm_cpu"])
        assert subprocess.run(["squeue", "-h"], capture_output=True, text=True, timeout=30).stdout.strip() == ""
    finally:
        stop_slurm_cluster(conf)
