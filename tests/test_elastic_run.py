"""The cell schedulers end to end: a real `mpirun` job (controller + 3 cells, each with its own engine and
Megatron replica) through the real CLI, for async, elastic and colocate_cells, the last with a satellite
and an engine killed on purpose. Uses the default warm start (cached under ~/.cache/gyre; built on the
first run); about a minute per run on 2 busy cores."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CELL_WORKLOAD, EVERY_STEP_TRAINS
from test_eval_run import check_row_against_shards
from tracking_readers import check_step_rows_in_trackers, tensorboard_scalars, tensorboard_tags

from gyre.sched.launch.local import DEAD_CELLS_EXIT_CODE

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = [*CELL_WORKLOAD, "train.micro_batch_tokens=1536"]  # a few micro-batches per group: work to spread


def run(
    tmp_path: Path, scheduler: str, *extra: str, rc: int = 0, env: dict[str, str] | None = None
) -> tuple[Path, list[dict], dict]:
    out = tmp_path / scheduler
    args = [f"scheduler={scheduler}", *WORKLOAD, *extra, f"output_dir={out}", f"hydra.run.dir={tmp_path / 'hydra'}"]
    proc = subprocess.run(
        [sys.executable, "-m", "launch.run", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=800,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == rc, proc.stdout[-3000:] + proc.stderr[-5000:]
    if rc == DEAD_CELLS_EXIT_CODE:  # it finished without them, and says how to accept that
        assert "Set sched.allow_dead_cells=true to accept that" in proc.stderr, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, rows, json.loads((out / "summary.json").read_text())


def check_common(out: Path, rows: list[dict], summary: dict, max_lag: int) -> list[dict]:
    steps = [r for r in rows if r["event"] == "step"]
    assert [r["step"] for r in steps] == [0, 1] and summary["steps"] == 2
    assert len(list((out / "shards").glob("step*-group*.h5"))) == 4  # one shard per group
    assert (out / "checkpoint" / "trainer" / ".metadata").stat().st_size > 0
    assert (out / "timeline.png").stat().st_size > 1000 and (out / "learning_curve.png").exists()
    for r in steps:
        assert r["n_rollouts"] == 16 and r["wall_s"] > 0 and r["behaviour_lag_max"] <= max_lag
        assert sum(r["contributors"].values()) == r["micro_batches"]  # each micro-batch reduced exactly once
        # rl.mismatch's diagnostics per cell that trained (behaviour up to max_lag versions old: not ~0 here)
        assert set(r["mismatch_by_cell"]) == set(r["contributors"]), r
        assert all(m["mismatch/kl_k3"] >= 0.0 and m["mismatch/ratio_p05"] <= m["mismatch/ratio_p95"]
                   for m in r["mismatch_by_cell"].values()), r  # fmt: skip
    calls = [json.loads(line) for line in (out / "calls.jsonl").read_text().splitlines()]
    calls = [c for c in calls if not c["rollout_id"].startswith("e")]  # eval sessions: checked on their own
    assert calls and all(c["weight_version"] in ("0", "1") for c in calls)  # every call carries its version
    assert summary["continued_recomputed_tokens"] == 0  # rerouted calls recomputed nothing
    return steps


def switches(rows: list[dict], direction: str) -> list[dict]:
    return [r for r in rows if r["event"] == "switch" and r["direction"] == direction and not r["initial"]]


# elastic also evaluates after every step: eval sessions fill only rollout slots that training leaves idle
EVAL_EVERY_STEP = ["eval.every=1", "eval.max_tasks=2", "eval.samples=2"]


@pytest.mark.parametrize("scheduler", ["async", "elastic"])
def test_scheduler_runs_as_an_mpi_job_of_cells(tmp_path: Path, scheduler: str) -> None:
    extra = ["logger=[tensorboard,wandb]", *EVAL_EVERY_STEP] if scheduler == "elastic" else []
    tmp = tmp_path / "tmp"  # the job's own TMPDIR: what its ranks leave there is theirs alone
    tmp.mkdir()
    env = {"TMPDIR": str(tmp), "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path)}
    out, rows, summary = run(tmp_path, scheduler, *extra, env=env)
    # megatron imports wandb where installed (the cells keep it out), the controller's tracker does: wandb's
    # temporary directories, removed by its atexit hooks, would stay behind ranks that leave with os._exit
    assert not list(tmp.glob("tmp*wandb-*"))
    check_common(out, rows, summary, max_lag=1)
    cells = json.loads((out / "cells.json").read_text())
    assert [c["cell"] for c in cells] == [0, 1, 2] and len({c["engine_url"] for c in cells}) == 3
    assert all(c["cpus"] for c in cells)
    to_train, to_rollout = switches(rows, "rollout->train"), switches(rows, "train->rollout")
    if scheduler == "async":  # a static split: the core trains, the satellites serve, nobody moves
        assert not to_train and not to_rollout
        assert [(r["cell"], r["direction"]) for r in rows if r["event"] == "switch"] == [(0, "rollout->train")]
    else:  # the core first; a release leaves capacity for every active session, or gives waiting training the core
        assert to_train[0]["cell"] == 0
        for r in to_train:
            if r["reason"] == "surplus":
                assert r["serving_after"] * 4 >= r["level"]  # sched.capacity_per_cell=4
            else:
                assert (r["reason"], r["cell"], r["together"]) == ("training_waits", 0, 1)
        assert all(r["latency_s"] > 0 for r in to_train + to_rollout)
        assert summary["switch_median_s"]["rollout->train"] > 0
        check_decisions(rows)
        check_trackers(out, rows)
        check_evals_never_held_up_training(out, rows)
    check_loop_never_stands_still(rows)


def check_loop_never_stands_still(rows: list[dict]) -> None:
    """Shards are written and planned on the writer's thread: in no step did handing groups over, taking
    them back, or asking the policy take the controller's loop 50 ms of work. Its CPU seconds, not its wall:
    on 2 cores at a load of 40-60 a thread that does 4 ms of work waits 200 ms for a CPU (the wall is in
    loop_max_s beside it)."""
    steps = [r for r in rows if r["event"] == "step"]
    for phase in ("sessions", "groups", "decide"):
        assert all(r["loop_max_cpu_s"].get(phase, 0.0) < 0.05 for r in steps), [r["loop_max_s"] for r in steps]
    groups = [r for r in rows if r["event"] == "group"]
    assert len(groups) == 4 and all(r["seconds"] > 0 and r["blocked_s"] == 0.0 for r in groups)


def check_decisions(rows: list[dict]) -> None:
    """Every switch the policy chose is logged as a decision, before the switch, with the state it saw."""
    decisions = [r for r in rows if r["event"] == "decision"]
    chosen = [(c, role, why) for d in decisions for c, role, why in d["switches"]]
    made = [(r["cell"], r["direction"].split("->")[1], r["reason"]) for r in rows if r["event"] == "switch"]
    assert sorted(chosen) == sorted(m for m in made if m[2])  # the initial roles are no decision
    for d in decisions:
        assert d["queued"] + d["running"] >= 0 and d["cells"] and d["decide_s"] >= 0 and d["loop_s"] >= 0


def check_evals_never_held_up_training(out: Path, rows: list[dict]) -> None:
    """The baseline ran before any training session; every due version was evaluated or abandoned for the
    next one; each eval row was served by its own weights alone and agrees with its shards; at every change of
    the driver's counts, eval sessions held only slots no running or waiting training session wanted (one that
    wanted a slot took it at once: the eval session was preempted and ran again later); and, from the session
    rows, no training session that waited for a slot waited while an eval session ran."""
    evals = [r for r in rows if r["event"] == "eval"]
    abandoned = [r for r in rows if r["event"] == "eval_abandoned"]
    # the baseline owns the cells before the first step's sessions, the last version's after the last step
    assert evals[0]["version"] == 0 and evals[-1]["version"] == 2
    assert evals[0]["t"] < next(r["started"] for r in rows if r["event"] == "session" and r["kind"] == "train")
    assert sorted(r["version"] for r in evals + abandoned) == [0, 1, 2]
    assert all(r["replaced_by"] == r["version"] + 1 for r in abandoned)
    for r in evals:
        assert r["weight_versions"] == [str(r["version"])]
        check_row_against_shards(out, r, samples=2)  # pass@k from the shards; no eval rollout has loss weight
    assert sorted(p.name for p in (out / "shards_eval").glob("*.h5")) == sorted(n for r in evals for n in r["shards"])
    slots = json.loads((out / "timeline.json").read_text())["slots"]
    assert slots and max(s[4] for s in slots) > 0  # eval sessions did run
    for _, queued_train, running_train, _, running_eval, capacity in slots:
        assert running_eval <= max(0, capacity - running_train - queued_train)
    sessions = [r for r in rows if r["event"] == "session"]
    # an eval session's slot: from its start to its harness's end (it is graded outside the slot)
    eval_runs = [
        (r["started"], r["started"] + r["seconds"] - r.get("grade_s", 0.0)) for r in sessions if r["kind"] == "eval"
    ]
    waits = [
        (r["started"] - r["queued_s"], r["started"]) for r in sessions if r["kind"] == "train" and r["queued_s"] > 1
    ]
    assert waits  # training sessions did wait for slots (16 per step, 4 per cell)
    for w0, w1 in waits:
        assert all(min(w1, e1) - max(w0, e0) <= 0.05 for e0, e1 in eval_runs), (w0, w1)
    assert all(r["kind"] == "eval" for r in sessions if r.get("preempted"))


def check_trackers(out: Path, rows: list[dict]) -> None:
    """logger=[tensorboard,wandb] in a cell job: the controller's step rows in both, every switch event and
    both images in TensorBoard."""
    (tb_dir,) = (out / "tensorboard").iterdir()
    check_step_rows_in_trackers(tb_dir, out / "wandb", [r for r in rows if r["event"] == "step"])
    tb = tensorboard_scalars(tb_dir)
    latencies = [r["latency_s"] for r in rows if r["event"] == "switch"]
    assert [tb["events/switch/latency_s"][i] for i in range(len(latencies))] == pytest.approx(latencies, rel=1e-6)
    assert sorted(tensorboard_tags(tb_dir)["images"]) == ["learning_curve", "timeline"]


def test_colocate_cells_survive_a_killed_satellite_and_a_killed_engine(tmp_path: Path) -> None:
    faults = "sched.faults=[kill_engine:1:after_calls:6,kill_cell:2:after_micro_batches:1]"
    # small micro-batches: even a step with few trainable rollouts has one for every cell, the victim included.
    # The run finishes without the dead cell and exits non-zero, since sched.allow_dead_cells is not set
    out, rows, summary = run(
        tmp_path, "colocate_cells", faults, "train.micro_batch_tokens=512", rc=DEAD_CELLS_EXIT_CODE
    )
    steps = check_common(out, rows, summary, max_lag=0)
    # every living cell switches, all together, both ways
    to_train, to_rollout = switches(rows, "rollout->train"), switches(rows, "train->rollout")
    assert len(to_train) >= 5 and len(to_rollout) >= 2 and all(r["latency_s"] > 0 for r in to_train + to_rollout)
    assert {r["together"] for r in to_train[:3]} == {3}
    # the engine died mid-request: the proxy rerouted, the cell started another, no harness failed
    assert {r["cell"] for r in rows if r["event"] == "engine_died"} == {1}
    assert all(r["n_excluded"] == 0 for r in steps)
    # the satellite died mid-step: its micro-batches were trained again elsewhere, each counted once
    assert summary["dead_cells"] == [2] and summary["dead_cell_reasons"] == {"2": "its rank died"}
    assert sorted(f["fault"] for f in summary["faults"]) == ["kill_cell", "kill_engine"]
    (died,) = [r for r in rows if r["event"] == "cell_died"]
    assert died["cell"] == 2 and died["requeued_micro_batches"] >= 1 and died["reason"] == "its rank died"
    assert sum(r["mb_reassigned"] for r in steps) >= 1
    assert all("2" not in r["contributors"] for r in steps)


def test_cells_of_two_ranks_train_tensor_parallel_and_stop_with_every_shard(tmp_path: Path) -> None:
    """A core and a satellite of 2 ranks each, train.tensor_parallel=2: every living cell trains each step
    (colocate_cells), the satellite's shards reduce to the core's, the engines serve the gathered weights.
    SIGTERM to `launch.run` after a step (passed to rank 0 as SIGUSR2): rank 0 checkpoints the completed steps,
    each rank's shard among them, and the job exits 75. (The resume from those shards, and the elastic
    scheduler's stop and resume: tests/test_slurm_cell_job.py, under Slurm.)"""
    out = tmp_path / "cells"
    layout = ["train.tensor_parallel=2", "cluster.core.tasks_per_node=2", "cluster.satellites=[{tasks_per_node:2}]"]
    # micro-batches of 512 tokens: enough of them in every step for both cells to train some
    args = [
        "scheduler=colocate_cells",
        *WORKLOAD,
        *EVERY_STEP_TRAINS,
        *layout,
        "train.micro_batch_tokens=512",
        "steps=3",
    ]
    args += ["tasks.tool_time_s=0.5", f"output_dir={out}"]
    cmd = [sys.executable, "-m", "launch.run", *args, f"hydra.run.dir={tmp_path / 'hydra'}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while '"event": "step"' not in (
            (out / "metrics.jsonl").read_text() if (out / "metrics.jsonl").exists() else ""
        ):
            assert proc.poll() is None and time.monotonic() < deadline, "no step completed"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        first, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 75, first[-3000:]
    assert {p.name for p in (out / "checkpoint" / "trainer").glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    stopped = json.loads((out / "checkpoint" / "state.json").read_text())
    assert 1 <= stopped["next_step"] < 3 and json.loads((out / "summary.json").read_text())["stopped_by"] == "SIGUSR2"
    assert [r["step"] for r in stopped["ledger"]] == list(range(stopped["next_step"]))
    cells = json.loads((out / "cells.json").read_text())
    assert [c["cell"] for c in cells] == [0, 1] and len({c["engine_url"] for c in cells}) == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(stopped["next_step"]))
    assert all(set(r["contributors"]) == {"0", "1"} for r in steps), [r["contributors"] for r in steps]
    assert all(sum(r["contributors"].values()) == r["micro_batches"] for r in steps)
    # the satellite's two ranks pulled their shards of each new version (its engine then serves them gathered)
    assert all(len(r["sync_pulled_bytes"]["1"]) == 2 and min(r["sync_pulled_bytes"]["1"]) > 0 for r in steps), steps
