"""The embedded RL run as a heterogeneous job on the local Slurm cluster (3 nodes; tests/conftest.py):
`launch.submit` writes the script and submits it, plainly or through submitit; the cell job runs as
one MPI world over the components (controller and core cell on node 1, a satellite on each other
node), trains two steps and writes shards and a checkpoint. Uses the default warm start (cached
under ~/.cache/gyre; built on the first run). The run via sbatch runs on the `loopback` cluster and via
submitit on the multi-host one (`netns`: each node its own address and hostname), as shipped
(`cluster=slurm_cpu`, nothing overridden about addresses); the requeue-resume run on `netns` (each pairing
once: the other two cost CI about three minutes and exercised no other code)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import h5py
import pytest
from conftest import CELL_WORKLOAD, EVERY_STEP_TRAINS, slurm_host_modes
from resume_job import adam_steps, shard_ids_by_step, wait_until
from slurm_jobs import job_active, job_record, mpich_segments, wait_for_end

from launch.slurm.het_executor import ACTIVE, HetSlurmJob, het_job_state
from launch.submit import main as submit_main

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[1]


# Who trains, decided by the scheduler's rules rather than by timing. Streaming training hands a group's
# micro-batches out the moment its shard is written, to the cells then training; under elastic the core trains
# alone while the satellites still serve, and a micro-batch takes it a tenth of a second, so with two groups per
# step the core drained the earlier group before a satellite was released (a fresh-clone run: core 6 + 3,
# satellites none). With one group per step, the step's group is complete only once none of its sessions is left,
# and each pass of the controller's loop switches roles before it hands out work: every satellite is released
# as surplus before that group's micro-batches go out, and idle cells take work satellites first
# (gyre.sched.policy.ledger.hand_out), so each cell trains as long as that step has three or more (512-token
# micro-batches: a group of 16 gave 5 in every run here). Staleness 0: with the default 1 the next step's
# sessions are admitted at once and keep the satellites serving through the first step, so only the last step
# could train them, and a step whose 16 rollouts all earn the same reward trains nothing (about 1 in 36 at this
# workload's rate, conftest.EVERY_STEP_TRAINS); now every step trains every cell, and the test fails only when
# both steps train nothing (about 1 in 1,300). Same 32 rollouts over 2 steps.
EVERY_CELL_TRAINS = ["rl.groups_per_step=1", "rl.group_size=16", "train.micro_batch_tokens=512", "sched.staleness=0"]


def _wait_for_end(job_id: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while (state := het_job_state(job_id)) in ACTIVE and time.monotonic() < deadline:
        time.sleep(0.5)
    return state


@pytest.mark.parametrize(
    ("via", "slurm_hosts"),
    [pytest.param(via, mode.values[0], marks=mode.marks, id=f"{via}-{mode.id}")
     for via, mode in zip(("sbatch", "submitit"), slurm_host_modes("loopback", "netns"), strict=True)],
    indirect=["slurm_hosts"],
)  # fmt: skip
def test_embedded_rl_run_as_a_het_job_across_three_nodes(tmp_path: Path, via: str, slurm_hosts: str, capsys) -> None:
    out = tmp_path / "run"
    args = ["--via", via, "--out", str(out), "cluster=slurm_cpu", f"cluster.python={sys.executable}"]
    submit_main([*args, f"cluster.workdir={ROOT}", *CELL_WORKLOAD, *EVERY_CELL_TRAINS])
    job_id = capsys.readouterr().out.split("submitted job ")[1].split(";")[0]
    if via == "submitit":  # submitit's own handle: one result per task, rank 0's the run's summary
        job = HetSlurmJob(folder=out / "slurm", job_id=job_id, tasks=range(4))
        try:
            results = job.results()
        except Exception as exc:  # submitit shows task 0's log only: the failing rank is often another one
            raise AssertionError(f"{het_job_state(job_id)}\n{job_logs(out)}") from exc
        assert results[0]["steps"] == 2 and results[1:] == [{"cell": 0}, {"cell": 1}, {"cell": 2}]
    state = _wait_for_end(job_id, 600)
    assert state == "COMPLETED", f"{state}\n{job_logs(out)}"

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["dead_cells"] == []
    cells = json.loads((out / "cells.json").read_text())
    assert [c["cell"] for c in cells] == [0, 1, 2] and len({c["slurm_node"] for c in cells}) == 3
    assert_every_cell_served_and_trained(out, cells, slurm_hosts)
    assert (out / "checkpoint" / "trainer" / ".metadata").stat().st_size > 0
    shards = sorted((out / "shards").glob("step*-group*.h5"))
    assert len(shards) == 2  # one per group (one group per step)
    ids = []
    for path in shards:
        with h5py.File(path, "r") as f:
            ids += [x.decode() if isinstance(x, bytes) else str(x) for x in f["rollouts"]["rollout_id"][:]]
    assert len(ids) == 32 and len(set(ids)) == 32  # every rollout once


def test_a_start_that_never_brings_the_mpi_world_up_is_ended_and_run_again(tmp_path: Path, capsys) -> None:
    """A rank stuck before the world is up (as in a hung MPI_Init; here an injected stall of satellite 1
    on the first start): the script's start-up guard ends that start after cluster.mpi_start_timeout_s
    and starts the step again, and the run completes on the second start. The ended start's ranks leave no
    shared memory behind (the script removes what MPICH left on every node after a failed start)."""
    out, segments_before = tmp_path / "run", mpich_segments()
    args = ["--via", "sbatch", "--out", str(out), "cluster=slurm_cpu", f"cluster.python={sys.executable}"]
    args += [f"cluster.workdir={ROOT}", *CELL_WORKLOAD, "steps=1", "cluster.mpi_start_timeout_s=20"]
    submit_main([*args, "sched.faults=['stall_start:1:attempts:1']"])
    job_id = capsys.readouterr().out.split("submitted job ")[1].split(";")[0]
    state = _wait_for_end(job_id, 600)
    batch_log = (out / "slurm" / f"{job_id}_batch.out").read_text()
    assert state == "COMPLETED", f"{state}\n{job_logs(out)}"
    assert "gyre: the MPI world did not come up (start 1 of 3, 20 s); ending the step" in batch_log, batch_log
    assert "start 2 of 3" not in batch_log
    assert json.loads((out / "summary.json").read_text())["steps"] == 1
    assert not list((out / "slurm").glob("*.world_up"))  # the marker of the start that came up is removed
    assert not mpich_segments() - segments_before, batch_log


@pytest.mark.parametrize("slurm_hosts", slurm_host_modes("netns"), indirect=True)
def test_het_job_stopped_mid_run_resumes_from_its_checkpoint(tmp_path: Path, slurm_hosts: str, capsys) -> None:
    """The time-limit signal (`--signal=B:TERM`, sent here with `scancel --batch`) mid-run: the script
    passes it to the ranks, the controller checkpoints the completed steps and exits 75, the script
    requeues the job, and the requeued job resumes there: every step once, every rollout once."""
    out, steps = tmp_path / "run", 3
    args = ["--via", "sbatch", "--out", str(out), "cluster=slurm_cpu", f"cluster.python={sys.executable}"]
    args += [f"cluster.workdir={ROOT}", *CELL_WORKLOAD, f"steps={steps}", "tasks.tool_time_s=0.5"]
    submit_main(args)
    job = capsys.readouterr().out.split("submitted job ")[1].split(";")[0]
    log = out / "slurm" / f"{job}_batch.out"
    try:
        wait_until("a completed step", lambda: completed_steps(out), 300, lambda: job_active(job))
        subprocess.run(["scancel", "--batch", "--signal=TERM", job], check=True, timeout=30)
        final_state = wait_for_end(job, 600)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    controller = (out / "slurm" / f"{job}_cells_0.out").read_text()
    assert final_state == "COMPLETED", f"{final_state}\n{log.read_text()[-3000:]}\n{controller[-3000:]}"
    assert "requeueing job" in log.read_text() and f"gyre: job {job} (restart 1)" in log.read_text()
    assert "SIGUSR2: stopping at step" in controller
    resumed = re.search(rf"resuming {re.escape(str(out))} from \S+ at step (\d+) of {steps}", controller)
    assert resumed is not None and 1 <= int(resumed[1]) < steps, controller[-3000:]

    st = json.loads((out / "checkpoint" / "state.json").read_text())
    assert [r["step"] for r in st["ledger"]] == list(range(steps)), "a step missing or trained twice"
    assert [r["start"] for r in st["ledger"]] == [0] * int(resumed[1]) + [1] * (steps - int(resumed[1]))
    assert [s.get("slurm_restart_count", "0") for s in st["starts"]] == ["0", "1"]
    stored = shard_ids_by_step(out)
    for record in st["ledger"]:
        step = record["step"]
        expected = sorted(f"s{step}-g{g}-r{i}" for g in range(2) for i in range(8))
        assert sorted(stored[step]) == expected == record["rollouts"], f"step {step}: rollouts lost or stored twice"
        assert set(record["trained"]) <= set(record["rollouts"])
    assert adam_steps(out) == sum(1 for r in st["ledger"] if r["trained"]), "optimizer state not carried over"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["event"] == "step"] == list(range(steps))


@pytest.mark.parametrize("slurm_hosts", slurm_host_modes("netns"), indirect=True)
def test_a_satellite_killed_holding_a_micro_batch_is_seen_at_once_and_the_job_exits_as_the_controller_decides(
    tmp_path: Path, slurm_hosts: str, capsys
) -> None:
    """Satellite 2 SIGKILLed on its own host right after its first micro-batch is sent (colocate_cells: every
    cell trains the step, satellites served first). /proc cannot see another host and sched.cell_timeout_s is
    120 s: the controller sees the rank gone within seconds because its liveness connection closed, and the
    micro-batch is trained elsewhere, so the step does not stall. srun's status is its worst task's (the
    killed one: 137); the job's is the controller's: COMPLETED with sched.allow_dead_cells=true (without it,
    FAILED with exit code 3: tests/test_slurm_multihost.py). The world ended without MPI_Finalize, and the
    script removed the shared memory it left on each node."""
    out, segments_before = tmp_path / "run", mpich_segments()
    args = ["--via", "sbatch", "--out", str(out), "cluster=slurm_cpu", f"cluster.python={sys.executable}"]
    args += [f"cluster.workdir={ROOT}", *CELL_WORKLOAD, "steps=1", "scheduler=colocate_cells"]
    args += ["train.micro_batch_tokens=512", "sched.faults=[kill_cell:2:after_micro_batches:1]"]
    submit_main([*args, "sched.allow_dead_cells=true"])
    job = capsys.readouterr().out.split("submitted job ")[1].split(";")[0]
    state = _wait_for_end(job, 600)
    logs = job_logs(out)
    assert state == "COMPLETED", f"{state}\n{logs}"
    assert job_record(job).get("ExitCode") == "0:0", f"{job_record(job)}\n{logs}"
    assert "gyre: exit 0, the controller's (srun: 137, its worst task)" in logs, logs
    assert not mpich_segments() - segments_before, logs

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["dead_cells"] == [2]
    assert summary["dead_cell_reasons"] == {"2": "its rank died"}
    (killed,) = summary["faults"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (died,) = [r for r in rows if r["event"] == "cell_died"]
    assert died["cell"] == 2 and died["requeued_micro_batches"] >= 1
    assert died["t"] - killed["t"] < 10.0, (killed, died)  # within seconds, not sched.cell_timeout_s (120 s)
    (step,) = [r for r in rows if r["event"] == "step"]
    assert step["mb_reassigned"] >= 1 and "2" not in step["contributors"]
    assert sum(step["contributors"].values()) == step["micro_batches"]  # each micro-batch reduced exactly once


def assert_every_cell_served_and_trained(out: Path, cells: list[dict], slurm_hosts: str) -> None:
    """Per node, from the call log and the step metrics: every cell's engine served calls and every cell
    trained micro-batches; on the multi-host cluster each cell advertised its own node's address."""
    served = Counter(urlsplit(json.loads(line)["engine_url"]).netloc for line in (out / "calls.jsonl").open())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = Counter()
    for row in rows:
        if row["event"] == "step":
            trained.update({int(c): n for c, n in row["contributors"].items()})
    for c in cells:
        where = f"cell {c['cell']} on {c['slurm_node']} ({c['engine_url']})"
        assert served[urlsplit(c["engine_url"]).netloc] > 0, f"{where} served no call: {dict(served)}"
        assert trained[c["cell"]] > 0, f"{where} trained nothing: {dict(trained)}"
    hosts = [urlsplit(c["engine_url"]).hostname for c in cells]
    if slurm_hosts == "netns":  # node i is 10.200.0.(10 + i) (slurm/cluster.sh)
        assert sorted(hosts) == ["10.200.0.11", "10.200.0.12", "10.200.0.13"], hosts
        assert sorted(c["address"] for c in cells) == sorted(hosts)


def job_logs(out: Path) -> str:
    """The end of every log of the job (batch script and each rank, stdout and stderr)."""
    return "".join(f"--- {p.name}\n{p.read_text()[-3000:]}\n" for p in sorted((out / "slurm").glob("*.[oe][ur][tr]")))


def completed_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return sum(1 for line in text.splitlines() if '"event": "step"' in line)


@pytest.mark.parametrize("slurm_hosts", slurm_host_modes("netns"), indirect=True)
def test_cells_of_two_ranks_one_spanning_two_hosts_stopped_mid_run_resume(
    tmp_path: Path, slurm_hosts: str, capsys
) -> None:
    """cluster=slurm_cpu_tp2_nodes on the multi-host cluster, train.tensor_parallel=2: the core cell is 2 nodes
    x 1 task, its TP=2 world over gloo between two hosts' own addresses (the controller beside its rank 0), the
    satellite 1 node x 2 tasks; each rank found its place from Slurm's variables. Both cells train each step
    (colocate_cells) and the satellite's ranks pull their shards of each version through Mooncake. Stopped by
    the time-limit signal after a step, every rank stops, the job requeues and resumes from the sharded
    checkpoint each rank wrote: every step once, the optimizer's steps carried over."""
    out, steps = tmp_path / "run", 2
    args = ["--via", "sbatch", "--out", str(out), "cluster=slurm_cpu_tp2_nodes", f"cluster.python={sys.executable}"]
    # micro-batches of 512 tokens: enough of them in every step for both cells to train some (one group with
    # signal and the default budget can make one micro-batch, which only one cell then trains)
    workload = [
        *CELL_WORKLOAD,
        *EVERY_STEP_TRAINS,
        "scheduler=colocate_cells",
        "train.micro_batch_tokens=512",
        f"steps={steps}",
    ]
    submit_main([*args, f"cluster.workdir={ROOT}", *workload, "tasks.tool_time_s=0.5"])
    job = capsys.readouterr().out.split("submitted job ")[1].split(";")[0]
    log = out / "slurm" / f"{job}_batch.out"
    try:
        wait_until("a completed step", lambda: completed_steps(out), 400, lambda: job_active(job))
        subprocess.run(["scancel", "--batch", "--signal=TERM", job], check=True, timeout=30)
        state = wait_for_end(job, 700)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    assert state == "COMPLETED", f"{state}\n{job_logs(out)}"
    assert "requeueing job" in log.read_text() and f"gyre: job {job} (restart 1)" in log.read_text()
    controller = (out / "slurm" / f"{job}_cells_0.out").read_text()
    resumed = re.search(rf"resuming {re.escape(str(out))} from \S+ at step (\d+) of {steps}", controller)
    assert resumed is not None and 1 <= int(resumed[1]) < steps, controller[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps and summary["dead_cells"] == []
    cells = json.loads((out / "cells.json").read_text())
    where = [[(r["rank"], r["slurm_node"], r["address"]) for r in c["ranks"]] for c in cells]
    assert where == [  # node i is 10.200.0.(10 + i) (slurm/cluster.sh)
        [(1, "node1", "10.200.0.11"), (2, "node2", "10.200.0.12")],
        [(3, "node3", "10.200.0.13"), (4, "node3", "10.200.0.13")],
    ], where
    st = json.loads((out / "checkpoint" / "state.json").read_text())
    assert [r["step"] for r in st["ledger"]] == list(range(steps)), "a step missing or trained twice"
    assert adam_steps(out) == sum(1 for r in st["ledger"] if r["trained"]), "optimizer state not carried over"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["event"] == "step"]
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(set(r["contributors"]) == {"0", "1"} for r in rows)
    assert all(sum(r["contributors"].values()) == r["micro_batches"] for r in rows)
    calls = [json.loads(line) for line in (out / "calls.jsonl").read_text().splitlines()]
    assert {c["weight_version"] for c in calls} == {"0", "1"}  # the engines served each version
    last = {c["rollout_id"]: c["weight_version"] for c in calls}  # in file order: the resumed start's calls come last
    assert st["ledger"][-1]["start"] == 1 and {last[r] for r in st["ledger"][-1]["rollouts"]} == {"1"}  # resumed too
    # each satellite rank pulled its own shard of each version from the core's rank (across hosts), about half
    pulled = [r["sync_pulled_bytes"]["1"] for r in rows]
    assert all(len(p) == 2 and 0.45 < p[0] / sum(p) < 0.55 for p in pulled), pulled
    assert {p.name for p in (out / "checkpoint" / "trainer").glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
