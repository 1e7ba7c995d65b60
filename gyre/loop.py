"""The main job, colocate mode: one cell alternates between serving rollouts and training."""

from __future__ import annotations

import time
from contextlib import closing
from pathlib import Path

from omegaconf import OmegaConf
from tqdm import tqdm

from gyre.config.schema import RunConfig
from gyre.harness.preflight import check_harness_fits
from gyre.health import ExclusionWatch, success_over
from gyre.metrics import MetricsWriter, plot_learning_curve
from gyre.pipeline import loss_rollouts, rl_micro_batches, tree_gspo_loss_fn, with_signal
from gyre.resume.checkpoint import Checkpointer, load_checkpoint
from gyre.resume.preemption import Preempted, PreemptionGuard
from gyre.resume.recovery import checkpoint_due, describe_start, prepare_resume, task_pool_position
from gyre.resume.state import RunState
from gyre.rollouts import RolloutService, StepRollouts
from gyre.sandbox.limits import raise_open_file_limit
from gyre.sched.policy import SCHEDULERS as CELL_SCHEDULERS
from gyre.store.reader import Shard, read_shard
from gyre.tasks.suite import TaskPool
from gyre.tracking import open_trackers
from gyre.train.trainer import Trainer, make_trainer
from gyre.warm_start import prepare_policy


def run(cfg: RunConfig) -> Path:
    check_supported(cfg)
    raise_open_file_limit()  # before anything opens: no rollout's connections may exhaust the trainer's
    guard = PreemptionGuard().install()
    out = Path(cfg.output_dir or f"outputs/{time.strftime('%Y-%m-%d_%H-%M-%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    with guard.deferred():  # moving files aside is not cut halfway; a stop then comes before any work
        start = prepare_resume(out, cfg.resume, log=print)
    guard.raise_if_requested()
    state = start.state
    first_tasks = TaskPool(cfg.tasks.families, cfg.tasks.pool_size, seed=cfg.seed).for_step(0, cfg.rl.groups_per_step)
    policy = prepare_policy(cfg, log=print, check=lambda tok: check_harness_fits(cfg, first_tasks, tok))
    trainer = make_trainer(policy.model_cfg, cfg.train)
    trainer.load_hf_state_dict(policy.load_state())
    if start.checkpoint is not None:
        load_checkpoint(start.checkpoint, trainer)  # weights, optimizer, step counter, RNG states
    state.begin()  # this start (its Slurm job id and restart count) joins the run's history
    print(describe_start(start, cfg, out))
    checkpointer = Checkpointer(out, cfg.checkpoint_async)
    checkpointer.saved_step = state.next_step if start.checkpoint is not None else None
    writer = MetricsWriter(out, open_trackers(cfg, out))
    writer.rows = start.metrics_rows
    watch = ExclusionWatch(cfg.rl.max_excluded_fraction, cfg.rl.max_excluded_steps)
    with RolloutService(cfg, policy, out, start.kept) as service, closing(writer), closing(checkpointer):
        if state.weight_version:  # engines serve the checkpoint's weights, not the warm start
            service.load_weights(trainer.hf_state_dict(), version=state.weight_version)
        bar = tqdm(range(state.next_step, cfg.steps), desc="gyre", unit="step", dynamic_ncols=True,
                   initial=state.next_step, total=cfg.steps)  # fmt: skip
        try:
            for step in bar:
                guard.raise_if_requested()
                row = run_step(step, service, trainer, state, guard, writer, cfg, out)
                bar.set_postfix(progress(row))
                watch.observe(row)  # raises ExcludedRunError: the step's row is in metrics.jsonl already
                if checkpoint_due(cfg, step):
                    with guard.deferred():
                        checkpoint(checkpointer, state, trainer, cfg)
        except BaseException as stop:
            if not guard.requested or guard.section_failed:
                raise
            with guard.deferred():  # the trainer holds exactly the completed steps' updates
                checkpoint(checkpointer, state, trainer, cfg, final=True)
            print(f"gyre: stopped by {guard.signal_name} before step {state.next_step}; checkpoint in "
                  f"{out / 'checkpoint'}; run the same command again to continue")  # fmt: skip
            if isinstance(stop, Preempted):
                raise
            raise Preempted(guard.signal_name or "a signal") from stop
        writer.image("learning_curve", plot_learning_curve(writer.rows, out / "learning_curve.png"))
    print(summary(writer.rows, out, service.task_pool.skipped_causes()))
    return out


def run_step(
    step: int,
    service: RolloutService,
    trainer: Trainer,
    state: RunState,
    guard: PreemptionGuard,
    writer: MetricsWriter,
    cfg: RunConfig,
    out: Path,
) -> dict:
    """Rollouts, shards, update, weight sync, metrics row. A stop signal abandons the rollouts and shards
    (moved aside and re-run on resume) but never cuts the update: the step then completes, unsynced."""
    t0 = time.perf_counter()
    rollouts = service.collect(step)
    t1 = time.perf_counter()
    service.release_engines()
    shard_metrics, shard_paths = step_shards(rollouts)
    with guard.deferred():
        shards = [read_shard(p) for p in shard_paths]
        train_metrics, trained = train_step(trainer, shards, cfg)
        stored = [str(rid) for s in shards for rid in s.rollouts["rollout_id"]]
        rejected = sorted({r.outcome.rollout_id for r in rollouts.finished} - set(stored))
        state.record_step(step, stored, trained, [p.name for p in shard_paths], rejected)
        t2 = time.perf_counter()
        sync_weights(service, trainer, state, guard)
        t3 = time.perf_counter()
        row = step_metrics(step, rollouts, train_metrics | shard_metrics, t0, t1, t2, t3)
        writer.write(row)
    return row


def sync_weights(service: RolloutService, trainer: Trainer, state: RunState, guard: PreemptionGuard) -> None:
    """The engines get the new weights; not when stopping: Slurm signals every process of the job, so the
    engines may be gone, and the resumed run syncs them from the checkpoint."""
    if guard.requested:
        return
    try:
        service.sync_weights(trainer.hf_state_dict(), version=state.weight_version)
    except Exception:
        if not guard.requested:
            raise


def checkpoint(
    checkpointer: Checkpointer, state: RunState, trainer: Trainer, cfg: RunConfig, final: bool = False
) -> None:
    """The run's checkpoint of the completed steps (atomic), written in the background; `final`: on disk on return."""
    state.data = task_pool_position(cfg, state.next_step)
    if final:
        checkpointer.save_final(state, trainer)
    else:
        checkpointer.save(state, trainer)


def check_supported(cfg: RunConfig) -> None:
    """Fail before any work for settings this loop cannot run, rather than silently ignoring them."""
    if cfg.scheduler in CELL_SCHEDULERS:
        raise ValueError(
            f"scheduler={cfg.scheduler!r} runs cells as an MPI job, not in this loop: start it with "
            f"`python -m launch.run scheduler={cfg.scheduler}` (gyre.sched.launch.run_cells) or on Slurm "
            "with launch/submit.py"
        )
    supported = {"scheduler": ("colocate",), "train.backend": ("megatron",), "rl.algorithm": ("gspo",)}
    values = {"scheduler": cfg.scheduler, "train.backend": cfg.train.backend, "rl.algorithm": cfg.rl.algorithm}
    for key, value in values.items():
        if value not in supported[key]:
            raise ValueError(f"{key}={value!r} is not available yet; supported: {', '.join(supported[key])}")


def step_shards(rollouts: StepRollouts) -> tuple[dict, list[Path]]:
    """The step's shards, one per group (written as each group completed); returns token metrics and paths."""
    shards = rollouts.shards
    tokens, path_tokens = sum(s.tokens for s in shards), sum(s.path_tokens for s in shards)
    metrics = {
        "tree_tokens": float(tokens),
        "call_tokens_per_tree_token": path_tokens / tokens if tokens else 1.0,
        "excluded_from_training": float(sum(len(s.excluded) for s in shards)),
    }
    return metrics, [s.path for s in shards]


def train_step(trainer: Trainer, shards: list[Shard], cfg: RunConfig) -> tuple[dict[str, float], list[str]]:
    """One optimizer update on the step's shards; returns its metrics and the rollout ids it trained."""
    candidates = [r for s in shards for r in s.trainable()]
    rollouts = with_signal(candidates)  # zero advantage trains nothing
    n_loss = loss_rollouts(candidates, cfg.rl.loss_norm)
    batches = rl_micro_batches(
        rollouts,
        cfg.train.micro_batch_tokens,
        cfg.model.max_position_embeddings,
        step_rollouts=n_loss or 1,
        logprob_distribution=cfg.rl.logprob_distribution,
    )
    if not batches:
        return {"trained": 0.0}, []
    metrics = trainer.train_step(batches, tree_gspo_loss_fn(cfg.rl.clip_eps_low, cfg.rl.clip_eps_high, cfg.rl.mismatch))
    trained = sorted({rid for b in batches for rid in b.batch.rollout_ids})
    return {"trained": 1.0, "train_tokens": float(sum(b.n_tokens for b in batches)), **metrics}, trained


def step_metrics(
    step: int, rollouts: StepRollouts, train: dict[str, float], t0: float, t1: float, t2: float, t3: float
) -> dict:
    return {
        "step": step,
        **rollouts.summary(),
        **{f"train/{k}": v for k, v in train.items()},
        "rollout_s": round(t1 - t0, 3),
        "train_s": round(t2 - t1, 3),
        "sync_s": round(t3 - t2, 3),
        "wall_s": round(t3 - t0, 3),
    }


def progress(row: dict) -> dict[str, str]:
    """The progress bar's postfix: reward and success over the scored rollouts, and what was not scored."""
    scored = bool(row.get("n_scored"))
    return {
        "reward": f"{row['reward_mean']:.2f}" if scored else "-",
        "success": f"{row['success_rate']:.2f}" if scored else "-",
        "excluded": f"{row['n_excluded']}/{row['n_rollouts']}",
        "timeouts": str(row["n_timeouts"]),
    }


def summary(rows: list[dict], out: Path, skipped: dict[str, str] | None = None) -> str:
    k = max(1, len(rows) // 4)
    skipped_text = "".join(f"gyre: task {name} skipped: {cause}\n" for name, cause in sorted((skipped or {}).items()))

    def rate(rs: list[dict]) -> str:
        value, n = success_over(rs)
        excluded = sum(int(r.get("n_excluded", 0)) for r in rs)
        shown = "n/a" if value is None else f"{value:.2f}"
        return f"{shown} over the {{}} {k} steps ({n} rollouts scored, {excluded} excluded)"

    return (
        f"gyre: success rate {rate(rows[:k]).format('first')} -> {rate(rows[-k:]).format('last')}\n"
        f"{skipped_text}gyre: outputs in {out}"
    )
