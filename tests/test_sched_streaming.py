"""Streaming training is exact: micro-batches spread over replicas (one of them dying mid-step), gradients
summed on the core and scaled there, give the update a single replica makes over the same micro-batches.
The MPI reduction itself runs for real under mpirun."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre.config.schema import EvalConfig, MismatchConfig, ModelConfig, RunConfig, TrainConfig
from gyre.harness.runner import RolloutOutcome
from gyre.pipeline import FinishedRollout, tree_gspo_loss_fn, write_group_shard
from gyre.proxy.synthetic import make_record
from gyre.sched.controller.evaluation import EvalRunner
from gyre.sched.controller.group_writer import GroupJob, GroupWriter
from gyre.sched.controller.sessions import SessionDone
from gyre.sched.policy.ledger import MicroBatchLedger
from gyre.sched.replica import MicroBatchSource, core_step, flat_grads, plan_group
from gyre.store.reader import read_shard
from gyre.tasks.grading import Grade
from gyre.tasks.task import Task
from gyre.train.megatron_trainer import MegatronTrainer

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*")]

MODEL = ModelConfig(
    vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64
)
JOB = Path(__file__).with_name("sched_reduce_job.py")


def rollout(rid: str, group: int, score: float, seed: int) -> FinishedRollout:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 60, (12,), generator=g).tolist()
    out1, out2 = torch.randint(1, 60, (5,), generator=g).tolist(), torch.randint(1, 60, (4,), generator=g).tolist()
    lp1, lp2 = (-torch.rand(5, generator=g) - 0.5).tolist(), (-torch.rand(4, generator=g) - 0.5).tolist()
    c1 = make_record(1, prompt, out1, logprobs=lp1, rollout_id=rid)
    c2 = make_record(2, prompt + out1 + [3, 4], out2, logprobs=lp2, spliced=[(12, 5, 1)], rollout_id=rid)
    task = Task(task_id=f"t{group}", family="write_value", prompt="p")
    outcome = RolloutOutcome(rid, task, Grade("ok", score, int(score * 4), 4), 1.0, 2, "finish", False)
    return FinishedRollout(group, outcome, [c1, c2])


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunConfig, list[Path]]:
    torch.set_num_threads(1)
    cfg = RunConfig(model=MODEL, train=TrainConfig(lr=1e-2, micro_batch_tokens=70, grad_clip=1.0))
    out = tmp_path_factory.mktemp("shards")
    scores = [[1.0, 0.0, 0.5, 0.25], [0.0, 0.75, 1.0, 0.0], [0.5, 0.5, 1.0, 0.0]]
    paths = []
    for g, group in enumerate(scores):
        members = [rollout(f"s0-g{g}-r{i}", g, s, 100 * g + i) for i, s in enumerate(group)]
        paths.append(write_group_shard(cfg, out, 0, g, members).path)
    return cfg, paths


def replica(cfg: RunConfig, state: dict[str, torch.Tensor]) -> MegatronTrainer:
    trainer = MegatronTrainer(cfg.model, cfg.train)
    trainer.load_hf_state_dict(state)
    return trainer


@pytest.mark.integration
@pytest.mark.parametrize(
    "mismatch",
    [MismatchConfig(), MismatchConfig(proximal="trainer", correction="tis", level="sequence", cap=1.0)],
    ids=["engine-proximal", "trainer-proximal-tis"],  # each replica recomputes the proximal of what it trains
)
def test_streamed_step_over_replicas_equals_one_replica_step(
    shards: tuple[RunConfig, list[Path]], mismatch: MismatchConfig
) -> None:
    cfg, paths = shards
    torch.manual_seed(0)
    state = MegatronTrainer(cfg.model, cfg.train).hf_state_dict()
    loss_fn = tree_gspo_loss_fn(0.2, 0.2, mismatch)  # wide clip: ratios move, the clipped branch is exercised too
    source = MicroBatchSource(cfg)
    refs, n_rollouts = [], 0
    for p in paths:
        group_refs, trained, _ = plan_group(p, cfg)
        refs += group_refs
        n_rollouts += len(trained)
    assert len(refs) >= 4 and n_rollouts == 10  # the two 0.5s of group 2 sit at its mean: advantage 0

    # single replica: every micro-batch scaled by 1 / rollouts of the step, one train_step
    single = replica(cfg, state)
    batches = [dataclasses.replace(source.get(r), rollout_scale=1.0 / n_rollouts) for r in refs]
    single.zero_grad()
    single.forward_backward(batches, loss_fn)
    single_grads, _ = flat_grads(single.model)
    single.optimizer_step()

    # streaming: three replicas take micro-batches by progress as groups arrive; replica 2 dies after
    # training two of them, which go back to the others
    core, sat1, sat2 = (replica(cfg, state) for _ in range(3))
    book = MicroBatchLedger()
    cells = {0: core, 1: sat1, 2: sat2}
    alive = [0, 1, 2]
    for g, p in enumerate(paths):
        book.add(0, plan_group(p, cfg)[0])
        if g == 1:
            for _ in range(2):
                ref = book.take(0, 2)
                if ref is not None:
                    sat2.forward_backward([source.get(ref)], loss_fn)
                    book.done(2, ref)
            assert len(book.fail_cell(2)) == 2
            alive.remove(2)
        for cell in alive:  # each takes one as it gets free
            if (ref := book.take(0, cell)) is not None:
                cells[cell].forward_backward([source.get(ref)], loss_fn)
                book.done(cell, ref)
    while (ref := book.take(0, 1)) is not None:
        sat1.forward_backward([source.get(ref)], loss_fn)
        book.done(1, ref)
    contributors = book.close_step(0)
    assert sum(contributors.values()) == len(refs) and set(contributors) == {0, 1} and book.reassigned[0] == 2
    summed, has = flat_grads(core.model)
    sat_flat, sat_has = flat_grads(sat1.model)
    # the reduced gradient is the single replica's, up to fp32 summation order
    torch.testing.assert_close((summed + sat_flat) / n_rollouts, single_grads, rtol=1e-5, atol=1e-9)
    metrics = core_step(core, summed + sat_flat, has | sat_has, 1.0 / n_rollouts)
    assert metrics["skipped_step"] == 0.0

    # and so is the step; AdamW's first update is about lr * g / |g|, so where g is ~1e-9 summation noise
    # moves a weight by a fraction of lr: 2e-5 is 0.2% of lr
    moved = 0.0
    for name, want in single.hf_state_dict().items():
        got = core.hf_state_dict()[name]
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5, msg=lambda m, name=name: f"{name}: {m}")
        moved = max(moved, float((want - state[name]).abs().max()))
    assert moved > 1e-3  # the step really changed the weights (lr 1e-2)


@pytest.mark.integration
def test_gradients_reduce_to_the_core_over_mpi(tmp_path: Path) -> None:
    mpirun = Path(sys.executable).parent / "mpirun"
    assert mpirun.exists(), f"{mpirun} missing: `pip install mpi4py mpich` (tools/setup_env.sh)"
    out = tmp_path / "reduce.json"
    proc = subprocess.run(
        [str(mpirun), "-n", "4", sys.executable, "-m", "mpi4py", str(JOB), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["max_abs_diff"] == 0.0 and res["mask"] == [1, 1, 0, 1]
    assert res["idle_cpu_fraction"] < 0.2  # the core waited for a slow sender without spinning


@pytest.mark.integration
def test_cells_train_trees_over_the_budget_in_segments_exactly(shards: tuple[RunConfig, list[Path]]) -> None:
    cfg, paths = shards
    tiny = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_tokens=8))  # every tree splits
    torch.manual_seed(0)
    state = MegatronTrainer(cfg.model, cfg.train).hf_state_dict()
    loss_fn = tree_gspo_loss_fn(0.2, 0.2)
    grads = []
    for c in (cfg, tiny):
        refs = [r for p in paths for r in plan_group(p, c)[0]]
        source = MicroBatchSource(c)
        batches = [source.get(r) for r in refs]
        if c is tiny:
            assert all(type(b.batch).__name__ == "SplitTreeBatch" for b in batches)
        trainer = replica(c, state)
        trainer.zero_grad()
        trainer.forward_backward(batches, loss_fn)
        grads.append(flat_grads(trainer.model)[0])
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) < 1e-5


@pytest.mark.unit
def test_group_writer_writes_and_plans_off_the_callers_thread(tmp_path: Path) -> None:
    """The controller hands a completed group over and goes on: the shard is written and planned on the
    writer's thread (the same micro-batches as planning it inline), its rollouts stored by id whatever order
    they finished in, its workspaces removed; a failed write is raised to the caller when it next looks, not
    lost on the thread."""
    cfg = RunConfig(model=MODEL, train=TrainConfig(micro_batch_tokens=70))
    members = [rollout(f"s0-g0-r{i}", 0, s, i) for i, s in enumerate([1.0, 0.0, 0.5, 0.25])]
    workdirs = tmp_path / "rollouts"
    for m in members:
        (workdirs / m.outcome.rollout_id).mkdir(parents=True)
    writer = GroupWriter(cfg, tmp_path)
    try:
        writer.submit(GroupJob(0, 0, members[::-1], {}, workdirs))  # the last to start finished first
        (written,) = writer.drain(timeout=30)
        assert (written.step, written.group, written.shard.path.name) == (0, 0, "step00000-group0000.h5")
        shard = read_shard(written.shard.path)
        assert [r.rollout_id for r in shard] == [f"s0-g0-r{i}" for i in range(4)]
        refs, trained, n_loss = plan_group(written.shard.path, cfg)
        assert (written.refs, written.trained, written.loss_rollouts) == (refs, trained, n_loss) and refs
        assert written.write_s > 0 and not any(workdirs.iterdir())
        writer.submit(GroupJob(0, 1, members, {}, tmp_path / "none", handed_over=0.0))
        writer.submit(GroupJob(0, 2, [], {}, tmp_path / "none"))  # no members: write_group_shard fails
        with pytest.raises(RuntimeError, match="writing a group shard failed"):
            writer.drain(timeout=30)
    finally:
        writer.close()


@pytest.mark.unit
def test_eval_shards_are_written_by_the_writer_and_an_abandoned_evals_removed(tmp_path: Path) -> None:
    """An eval task's samples, once all in, are a job for the group writer (the loop writes no shard): written
    into shards_eval/ and never planned, their workspaces removed; the eval's row comes once its last shard is
    back, listing them; a shard of an eval abandoned while it was being written is removed when it comes back."""
    cfg = RunConfig(
        model=MODEL, train=TrainConfig(micro_batch_tokens=70), eval=EvalConfig(every=1, samples=2, max_tasks=2)
    )
    evals = EvalRunner(cfg, tmp_path)
    writer = GroupWriter(cfg, tmp_path / "shards")

    def run_eval(version: int) -> list[GroupJob]:
        jobs = []
        for job in evals.open(version):
            (tmp_path / "rollouts" / f"eval{version:04d}" / job.rollout_id).mkdir(parents=True)
            done = rollout(job.rollout_id, job.group, 1.0, len(jobs))
            outcome = dataclasses.replace(done.outcome, task=job.task)
            if (shard_job := evals.finished(SessionDone(job, outcome, 0.0, 1.0), done.calls)) is not None:
                jobs.append(shard_job)
        return jobs

    try:
        jobs = run_eval(1)
        assert [(j.kind, j.step, j.group) for j in jobs] == [("eval", 1, 0), ("eval", 1, 1)]
        assert evals.in_flight and not any(evals.shard_dir.iterdir())  # nothing written by the caller
        writer.submit(jobs[0])
        (first,) = writer.drain(timeout=30)
        assert first.kind == "eval" and (first.refs, first.trained, first.loss_rollouts) == ([], [], 0)
        assert evals.written(first) is None and evals.in_flight  # one shard still out
        writer.submit(jobs[1])
        (second,) = writer.drain(timeout=30)
        row = evals.written(second)
        assert row is not None and not evals.in_flight
        assert (
            row["shards"]
            == ["eval-v00001-task0000.h5", "eval-v00001-task0001.h5"]
            == sorted(p.name for p in evals.shard_dir.iterdir())
        )
        assert not any((tmp_path / "rollouts" / "eval0001").iterdir()) and not (tmp_path / "shards").exists()

        jobs = run_eval(2)
        writer.submit(jobs[0])
        evals.abandon(3)  # the next eval came due while that shard was being written
        evals.open(3)
        (late,) = writer.drain(timeout=30)
        assert evals.written(late) is None and not late.shard.path.exists()
    finally:
        writer.close()
