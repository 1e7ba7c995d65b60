"""Preemption-safe resume: checkpoint atomicity, moving unfinished steps aside, the stop signal, a run killed
mid-step. The main job stopped by SIGTERM mid-run and started again on the same output_dir: under Slurm, in
tests/test_slurm_requeue.py."""

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from resume_job import (
    GROUP_SIZE,
    GROUPS,
    ROOT,
    STEPS,
    adam_steps,
    assert_each_rollout_once,
    calls_by_rollout,
    mid_step_with_a_group_done,
    process_tree,
    shard_ids_by_step,
    state,
    still_running,
    tiny_args,
)
from resume_job import wait_until as wait_for

from gyre.config.load import compose
from gyre.config.schema import ModelConfig, RunConfig, TrainConfig
from gyre.harness.runner import RolloutOutcome
from gyre.metrics import read_metrics
from gyre.pipeline import FinishedRollout, write_group_shard
from gyre.proxy.synthetic import make_record
from gyre.resume import checkpoint as checkpoint_module
from gyre.resume.checkpoint import Checkpointer, load_checkpoint, save_checkpoint
from gyre.resume.kept_groups import restore_groups
from gyre.resume.preemption import Preempted, PreemptionGuard
from gyre.resume.recovery import ResumeError, prepare_resume
from gyre.resume.state import RunState, find_checkpoint, write_state
from gyre.sched.launch.mpich_leftovers import remove_leftovers
from gyre.tasks.grading import Grade
from gyre.tasks.task import Task
from gyre.train.megatron_trainer import MegatronTrainer
from launch.slurm.sbatch import render_main_job_sbatch

GOLDEN = Path(__file__).parent / "golden"
ORPHAN_GRACE_S = 10.0  # a SIGTERMed engine exits in well under a second; a busy machine may take longer


def _trainer() -> MegatronTrainer:
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=64)  # fmt: skip
    return MegatronTrainer(cfg, TrainConfig(num_threads=1))


def _train_once(trainer: MegatronTrainer) -> None:
    batch = SimpleNamespace(tokens=torch.randint(1, 64, (2, 12)))
    trainer.train_step([batch], lambda logp, mb: (-logp.mean(), {}))


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


@pytest.mark.unit
def test_checkpoint_round_trip_restores_weights_optimizer_state_and_rng(tmp_path):
    torch.manual_seed(0)
    trainer = _trainer()
    _train_once(trainer)
    run = RunState()
    run.begin()
    run.record_step(0, ["s0-g0-r0", "s0-g0-r1"], ["s0-g0-r1"], ["step00000-group0000.h5"])
    save_checkpoint(tmp_path, run, trainer)
    expected_draws = _draws()
    _train_once(trainer)  # moves on after the checkpoint

    restored = _trainer()
    loaded = load_checkpoint(find_checkpoint(tmp_path), restored)
    assert _draws() == expected_draws
    assert loaded.next_step == 1 and loaded.weight_version == 1 and loaded.ledger[0].trained == ["s0-g0-r1"]
    assert restored.step == 1 and adam_steps(tmp_path) == 1
    assert {int(s["step"]) for s in restored.optimizer.state_dict()["state"].values()} == {1}
    torch.manual_seed(0)
    reference = _trainer()
    _train_once(reference)
    for (name, a), b in zip(reference.model.state_dict().items(), restored.model.state_dict().values(), strict=True):
        if torch.is_tensor(a):
            assert torch.equal(a, b), name


@pytest.mark.unit
def test_an_async_checkpoint_holds_its_snapshot_not_later_updates(tmp_path, monkeypatch):
    """The write runs after the trainer and the run state moved on: it still holds the instant of save(), and
    state.json appears only once the checkpoint is complete."""
    torch.manual_seed(0)
    trainer = _trainer()
    _train_once(trainer)
    expected = {k: v.clone() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}
    gate, real_publish = threading.Event(), checkpoint_module.publish_checkpoint

    def held_publish(*args):
        assert gate.wait(60)
        return real_publish(*args)

    monkeypatch.setattr(checkpoint_module, "publish_checkpoint", held_publish)
    run = RunState()
    run.record_step(0, ["s0-g0-r0"], ["s0-g0-r0"], ["step00000-group0000.h5"])
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(run, trainer)
    run.record_step(1, ["s1-g0-r0"], [], [])
    _train_once(trainer)  # the next step's update, before the write began
    assert find_checkpoint(tmp_path) is None  # nothing published yet: no state.json points anywhere
    gate.set()
    assert checkpointer.wait() == tmp_path / "checkpoint"
    checkpointer.close()
    restored = _trainer()
    loaded = load_checkpoint(find_checkpoint(tmp_path), restored)
    assert loaded.next_step == 1 and [r.step for r in loaded.ledger] == [0]
    assert restored.step == 1 and adam_steps(tmp_path) == 1
    for name, value in restored.model.state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(value, expected[name]), name


@pytest.mark.unit
def test_a_crash_between_the_renames_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    trainer = _trainer()
    first = RunState(next_step=3, weight_version=3)
    save_checkpoint(tmp_path, first, trainer)
    real_rename = os.rename

    def crash_on_publish(src, dst):
        if str(src).endswith("checkpoint.tmp"):
            raise OSError("simulated crash")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_publish)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(tmp_path, RunState(next_step=4, weight_version=4), trainer)
    assert not (tmp_path / "checkpoint").exists()
    assert find_checkpoint(tmp_path) == tmp_path / "checkpoint.old"
    assert prepare_resume(tmp_path, "must", log=lambda _: None).state.next_step == 3
    monkeypatch.setattr(os, "rename", real_rename)
    save_checkpoint(tmp_path, RunState(next_step=4, weight_version=4), trainer)
    assert find_checkpoint(tmp_path) == tmp_path / "checkpoint"
    assert not (tmp_path / "checkpoint.old").exists() and not (tmp_path / "checkpoint.tmp").exists()


def _jsonl(path: Path, rows: list) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _run_dir_stopped_in_step_2(out: Path) -> None:
    """What a run stopped during step 2 leaves: checkpoint at step 2, plus step 2's partial outputs."""
    (out / "checkpoint").mkdir(parents=True)
    write_state(out / "checkpoint", RunState(next_step=2, weight_version=2))
    (out / "shards").mkdir()
    for name in ("step00000-group0000.h5", "step00001-group0000.h5", "step00002-group0000.h5",
                 ".step00002-group0001.h5.77.deadbeef.tmp"):  # fmt: skip
        (out / "shards" / name).write_bytes(b"x")
    (out / "rollouts" / "step0002" / "s2-g0-r0").mkdir(parents=True)
    _jsonl(out / "metrics.jsonl", [{"step": 0}, {"step": 1}, {"step": 2}])
    _jsonl(out / "calls.jsonl", [{"rollout_id": f"s{s}-g0-r0", "call_id": s} for s in (0, 1, 2, 2)])
    with (out / "calls.jsonl").open("a") as f:
        f.write('{"rollout_id": "s2-g0-r1", "inp')  # cut short by the stop


@pytest.mark.unit
def test_outputs_of_unfinished_steps_are_moved_aside_not_deleted(tmp_path):
    _run_dir_stopped_in_step_2(tmp_path)
    logs = []
    point = prepare_resume(tmp_path, "auto", log=logs.append)
    assert point.checkpoint == tmp_path / "checkpoint" and point.state.next_step == 2
    assert [r["step"] for r in point.metrics_rows] == [0, 1]
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [
        "step00000-group0000.h5",
        "step00001-group0000.h5",
    ]
    assert [json.loads(x)["rollout_id"] for x in (tmp_path / "calls.jsonl").read_text().splitlines()] == [
        "s0-g0-r0",
        "s1-g0-r0",
    ]
    aside = point.set_aside
    assert aside is not None and aside.parent == tmp_path / "preempted" and "aside" in logs[0]
    assert sorted(p.name for p in (aside / "shards").iterdir()) == [
        ".step00002-group0001.h5.77.deadbeef.tmp",
        "step00002-group0000.h5",
    ]
    assert (aside / "rollouts" / "step0002" / "s2-g0-r0").is_dir() and not (tmp_path / "rollouts" / "step0002").exists()
    assert len((aside / "calls.jsonl").read_text().splitlines()) == 3 and (aside / "metrics.jsonl").exists()
    manifest = json.loads((aside / "manifest.json").read_text())
    assert manifest["first_step"] == 2 and manifest["moved"]["call-log lines"] == 3


def _finished_group(step: int, group: int, version: str, scores: list[float]) -> list[FinishedRollout]:
    task = Task(task_id=f"t{group}", family="write_value", prompt="p")
    members = []
    for i, score in enumerate(scores):
        rid = f"s{step}-g{group}-r{i}"
        calls = [make_record(1, [5, 6, 7], [8, 9, 10 + i], rollout_id=rid), make_record(2, [5, 6, 7, 8], [11])]
        calls[1].rollout_id = rid
        for c in calls:
            c.weight_version = version
        grade = Grade("ok", score, int(score * 4), 4)
        members.append(FinishedRollout(group, RolloutOutcome(rid, task, grade, 1.5, 2, "finish", False), calls))
    return members


@pytest.mark.unit
def test_a_resume_keeps_the_completed_groups_of_the_interrupted_step(tmp_path):
    """Stopped in step 2 (checkpoint: steps 0-1, weight version 2): step 2's complete shards served by version 2 stay
    with their call-log lines and come back as finished groups; a shard served by a newer version, a half-written
    one and a later step's are moved aside."""
    (tmp_path / "checkpoint").mkdir()
    write_state(tmp_path / "checkpoint", RunState(next_step=2, weight_version=2))
    cfg, shards = RunConfig(), tmp_path / "shards"
    shards.mkdir()
    groups = {
        (1, 0): _finished_group(1, 0, "1", [1.0, 0.0]),
        (2, 0): _finished_group(2, 0, "2", [1.0, 0.25]),
        (2, 1): _finished_group(2, 1, "3", [0.5, 0.0]),
        (3, 0): _finished_group(3, 0, "2", [0.0, 1.0]),
    }
    written = {key: write_group_shard(cfg, shards, key[0], key[1], members) for key, members in groups.items()}
    (shards / ".step00002-group0002.h5.9.cafe.tmp").write_bytes(b"half")
    calls = [c.to_json() for members in groups.values() for m in members for c in m.calls]
    _jsonl(tmp_path / "calls.jsonl", calls)

    point = prepare_resume(tmp_path, "auto", log=lambda _: None)
    assert sorted(point.kept) == [0] and point.kept[0].shard == written[(2, 0)].path
    assert sorted(p.name for p in shards.iterdir()) == ["step00001-group0000.h5", "step00002-group0000.h5"]
    kept_ids = {json.loads(line)["rollout_id"] for line in (tmp_path / "calls.jsonl").read_text().splitlines()}
    assert kept_ids == {"s1-g0-r0", "s1-g0-r1", "s2-g0-r0", "s2-g0-r1"}
    assert json.loads((point.set_aside / "manifest.json").read_text())["kept"] == {"0": "step00002-group0000.h5"}

    tasks = [Task(task_id="t0", family="write_value", prompt="p")]
    restored = restore_groups(point.kept, tasks, tmp_path)[0]
    assert [m.outcome.rollout_id for m in restored.members] == ["s2-g0-r0", "s2-g0-r1"]
    assert [m.outcome.grade.score for m in restored.members] == [1.0, 0.25]
    assert [[c.call_id for c in m.calls] for m in restored.members] == [[1, 2], [1, 2]]
    assert restored.shard == written[(2, 0)]
    assert prepare_resume(tmp_path, "never", log=lambda _: None).kept == {}


@pytest.mark.unit
def test_resume_modes(tmp_path):
    with pytest.raises(ResumeError, match="resume=must"):
        prepare_resume(tmp_path / "fresh", "must")
    with pytest.raises(ResumeError, match="auto, never, must"):
        prepare_resume(tmp_path, "sometimes")
    assert prepare_resume(tmp_path / "fresh", "auto").checkpoint is None
    _run_dir_stopped_in_step_2(tmp_path / "old")
    point = prepare_resume(tmp_path / "old", "never", log=lambda _: None)
    assert point.checkpoint is None and point.state.next_step == 0 and point.metrics_rows == []
    assert not (tmp_path / "old" / "checkpoint").exists() and (point.set_aside / "checkpoint" / "state.json").exists()
    assert not list((tmp_path / "old" / "shards").iterdir())


@pytest.mark.unit
def test_a_step_is_recorded_once_and_in_order():
    run = RunState()
    run.begin({"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"})
    assert run.starts[0]["slurm_job_id"] == "42" and run.starts[0]["slurm_restart_count"] == "1"
    run.record_step(0, ["s0-g0-r0"], [], [])
    with pytest.raises(RuntimeError, match="expected step 1"):
        run.record_step(0, ["s0-g0-r0"], [], [])
    with pytest.raises(RuntimeError, match="twice"):
        run.record_step(1, ["s1-g0-r0", "s1-g0-r0"], [], [])


@pytest.fixture
def restore_signal_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.mark.unit
def test_an_engine_that_fails_a_switch_after_the_stop_signal_does_not_fail_the_run(restore_signal_handlers, capsys):
    """Slurm signals every process of the step, each cell's engine too: an engine can stop while its cell
    switches it back to rollout (CI: `RoleSwitch failed on rank 3: EngineError: ... Connection reset by peer`
    ended a stopping het job as FAILED, not requeued). A failed role switch or weight load is excused once the
    stop signal came, also when the engine's failure arrives a moment before the controller's own signal; the
    same failure without a signal, and any other work's failure, stays an error."""
    from gyre.comm.control import ControlError
    from gyre.comm.local_control import CELL_RANK, local_control_planes
    from gyre.comm.messages import Hello, RoleSwitch, Shutdown, WeightVersion
    from gyre.engine.client import EngineError
    from gyre.sched.controller.cell_table import Outbox
    from gyre.sched.controller.orchestrator import StopRequest

    def engine_gone(msg: object) -> None:
        raise EngineError("POST http://127.0.0.1:1/resume_memory_occupation failed: [Errno 104] Connection reset")

    controller, cell = local_control_planes()
    handlers = {RoleSwitch: engine_gone, WeightVersion: engine_gone, Hello: engine_gone}
    serving = threading.Thread(target=cell.serve, args=(handlers,), daemon=True)
    serving.start()
    stop = StopRequest(in_process=True)
    box = Outbox(controller, 30.0, excuse=lambda body: stop.excuse(body, grace_s=1.0))

    def call(body: object) -> dict:
        return box.call({CELL_RANK: body}, lambda body, ack: None, lambda: [])

    started = time.monotonic()
    with pytest.raises(ControlError, match="RoleSwitch failed on rank 1: EngineError: POST"):
        call(RoleSwitch(1, "rollout"))  # no signal within the grace: a failure
    assert time.monotonic() - started >= 1.0 and stop.name == ""
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()  # the engine first, the controller next
    acks = call(RoleSwitch(1, "rollout"))
    assert stop.name == "SIGTERM" and acks[CELL_RANK].error.startswith("EngineError: POST")
    assert call(WeightVersion("3"))[CELL_RANK].error.startswith("EngineError")
    with pytest.raises(ControlError, match="Hello failed on rank 1"):
        call(Hello())  # not an engine's work: an error even while stopping
    controller.send(CELL_RANK, Shutdown("done"))
    serving.join(10)
    out = capsys.readouterr().out
    assert out.count("failed on rank 1: EngineError") == 2
    assert "(after SIGTERM, which reaches the engines too; the run stops at its last completed step)" in out


@pytest.mark.unit
def test_a_stop_signal_waits_for_a_deferred_section_and_cuts_anything_else(restore_signal_handlers):
    guard = PreemptionGuard().install()
    with guard.deferred():
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        finished = True
    assert finished and guard.requested and guard.signal_name == "SIGUSR1"
    with pytest.raises(Preempted):
        guard.raise_if_requested()
    fresh = PreemptionGuard().install()
    with pytest.raises(Preempted, match="SIGTERM"):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    os.kill(os.getpid(), signal.SIGTERM)  # a second signal (Slurm's, then the batch shell's) is ignored
    time.sleep(0.01)
    assert fresh.signal_name == "SIGTERM" and not fresh.section_failed


@pytest.mark.unit
def test_main_job_sbatch_matches_golden():
    cfg = compose(["cluster=slurm_cpu", "cluster.workdir=/shared/gyre"])
    text = render_main_job_sbatch(cfg, ["python", "-m", "launch.run", "output_dir=/shared/runs/r1"], "/shared/runs/r1")
    path = GOLDEN / "main_job.sbatch"
    if os.environ.get("GYRE_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), "main_job.sbatch changed; if intended, regenerate with GYRE_UPDATE_GOLDEN=1"


def _kill_job(proc: subprocess.Popen, out: Path, scheduler: str, started: float) -> None:
    """SIGKILL the run's main process (the loop; under cells the controller, rank 0, which holds the step book), then
    the launcher's process group (launch.run, mpirun): a crash, no clean-up. Within seconds nothing the run started
    may be left: not its engines (each in a session of its own), MPI ranks, harnesses or checkers. What MPICH
    leaves (gyre.sched.launch.mpich_leftovers), which the launcher killed with it would have removed, the test
    removes."""
    run = process_tree(proc.pid)
    if scheduler != "colocate":
        os.kill(int((out / "controller.pid").read_text()), signal.SIGKILL)
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    deadline = time.monotonic() + ORPHAN_GRACE_S
    while (left := still_running(run)) and time.monotonic() < deadline:
        time.sleep(0.1)
    described = [_describe(pid) for pid in left]
    remove_leftovers(started)
    for pid in left:  # the run's own processes only: none of them may outlive the test
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the killed run still running after {ORPHAN_GRACE_S:g} s: {described}"


@pytest.fixture
def own_tmpdir():
    """A TMPDIR for a run the test SIGKILLs (short, for its Unix sockets): what the kill keeps the run from
    removing (its sessions' socket and grading directories, wandb's) goes with it, not left in /tmp."""
    path = Path(tempfile.mkdtemp(prefix="gyre-kill-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _describe(pid: int) -> str:
    try:
        return f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes().replace(bytes(1), b' ')[:120].decode()}"
    except OSError:
        return str(pid)


@pytest.mark.integration
@pytest.mark.timeout(1200)  # a warm start of minutes on a busy machine, then two starts of the job
@pytest.mark.parametrize("scheduler", ["colocate", "colocate_cells"])
def test_a_run_killed_mid_step_keeps_the_steps_completed_groups(tmp_path, scheduler, own_tmpdir):
    """SIGKILL in the middle of step k >= 2, one group's shard written and another group's rollouts running: the
    same command resumes at step k from the every-step checkpoint, keeps the written group (its shard untouched,
    none of its rollouts run again), runs only the others, and every step is trained once."""
    out = tmp_path / "run"
    one_group_at_a_time = (  # 8 rollouts at once: a group's shard is written while the next group runs
        ["harness.concurrency=8"]
        if scheduler == "colocate"
        else ["scheduler=colocate_cells", "cluster.satellites=[{}]", "sched.capacity_per_cell=4"]
    )
    args = tiny_args(out, tmp_path / "hydra", *one_group_at_a_time)
    cmd = [sys.executable, "-m", "launch.run", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(own_tmpdir)}
    log1 = tmp_path / "first.log"
    started = time.time()
    with log1.open("w") as f:
        first = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=f, env=env, start_new_session=True)
    try:
        found = wait_for("a group of step >= 2 written while another runs", lambda: mid_step_with_a_group_done(out),
                         600, lambda: first.poll() is None)  # fmt: skip
        _kill_job(first, out, scheduler, started)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    k, seen_shards = found
    # what the kill left: the shards seen written, and those of any group that finished before the kill landed
    kept_shards = {
        p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (out / "shards").glob(f"step{k:05d}-group*.h5")
    }
    assert {n: kept_shards.get(n) for n in seen_shards} == seen_shards
    before = calls_by_rollout(out)
    kept = sorted(int(name[-7:-3]) for name in kept_shards)
    kept_ids = {f"s{k}-g{g}-r{i}" for g in kept for i in range(GROUP_SIZE)}

    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming {out} from {out / 'checkpoint'} at step {k} of {STEPS}" in again.stdout, again.stdout[-3000:]
    assert f"keeping the completed groups {kept} of step {k}" in again.stdout
    for name, (inode, mtime) in kept_shards.items():  # the same file, never rewritten
        stat = (out / "shards" / name).stat()
        assert (stat.st_ino, stat.st_mtime_ns) == (inode, mtime), name
    after = calls_by_rollout(out)
    assert {rid: after[rid] for rid in kept_ids} == {rid: before[rid] for rid in kept_ids}  # none of them ran again
    assert all(after[f"s{k}-g{g}-r{i}"] for g in range(GROUPS) if g not in kept for i in range(GROUP_SIZE))
    rows = [r for r in read_metrics(out / "metrics.jsonl") if r.get("event", "step") == "step"]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["kept_groups"] for r in rows] == [kept if s == k else [] for s in range(STEPS)]
    assert rows[k]["n_rollouts"] == GROUPS * GROUP_SIZE
    final = state(out)
    assert [s["from_step"] for s in final["starts"]] == [0, k]
    assert kept_ids <= set(final["ledger"][k]["rollouts"]) and final["ledger"][k]["start"] == 1
    if scheduler == "colocate":
        assert_each_rollout_once(out)
    else:  # the controller's ledger: every step once, each stored rollout once, the optimizer carried over
        assert [r["step"] for r in final["ledger"]] == list(range(STEPS))
        shards = shard_ids_by_step(out)
        assert all(set(shards[r["step"]]) <= set(r["rollouts"]) for r in final["ledger"])

        assert all(len(set(ids)) == len(ids) for ids in shards.values())
        assert adam_steps(out) == sum(1 for r in final["ledger"] if r["trained"])
