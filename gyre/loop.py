"""The main job, colocate mode: one cell alternates between serving rollouts and training."""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import OmegaConf
from tqdm import tqdm

from gyre.config.schema import RunConfig
from gyre.metrics import MetricsWriter, plot_learning_curve
from gyre.rollouts import RolloutService, StepRollouts
from gyre.train.megatron_trainer import MegatronTrainer
from gyre.train.rl_batch import build_micro_batches, gspo_loss_fn
from gyre.train.warm_start import prepare_policy


def run(cfg: RunConfig) -> Path:
    check_supported(cfg)
    out = Path(cfg.output_dir or f"outputs/{time.strftime('%Y-%m-%d_%H-%M-%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    policy = prepare_policy(cfg, log=print)
    trainer = MegatronTrainer(policy.model_cfg, cfg.train)
    trainer.load_hf_state_dict(policy.load_state())
    writer = MetricsWriter(out)
    with RolloutService(cfg, policy, out) as service:
        bar = tqdm(range(cfg.steps), desc="gyre", unit="step", dynamic_ncols=True)
        for step in bar:
            t0 = time.perf_counter()
            rollouts = service.collect(step)
            t1 = time.perf_counter()
            service.release_engines()
            train_metrics = train_step(trainer, rollouts, cfg)
            t2 = time.perf_counter()
            service.sync_weights(trainer.hf_state_dict(), version=step + 1)
            t3 = time.perf_counter()
            row = step_metrics(step, rollouts, train_metrics, t0, t1, t2, t3)
            writer.write(row)
            bar.set_postfix(reward=f"{row['reward_mean']:.2f}", success=f"{row['success_rate']:.2f}")
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                trainer.save(out / "checkpoint" / "trainer.pt")
    plot_learning_curve(writer.rows, out / "learning_curve.png")
    print(summary(writer.rows, out))
    return out


def check_supported(cfg: RunConfig) -> None:
    """Fail before any work for settings this version cannot run, rather than silently ignoring them."""
    supported = {"scheduler": ("colocate",), "train.backend": ("megatron",), "rl.algorithm": ("gspo",)}
    values = {"scheduler": cfg.scheduler, "train.backend": cfg.train.backend, "rl.algorithm": cfg.rl.algorithm}
    for key, value in values.items():
        if value not in supported[key]:
            raise ValueError(f"{key}={value!r} is not available yet; supported: {', '.join(supported[key])}")


def train_step(trainer: MegatronTrainer, rollouts: StepRollouts, cfg: RunConfig) -> dict[str, float]:
    batches = build_micro_batches(rollouts.scored, cfg.train.micro_batch_tokens, rollouts.pad_id)
    if not batches:
        return {"trained": 0.0}
    metrics = trainer.train_step(batches, gspo_loss_fn(cfg.rl.clip_eps_low, cfg.rl.clip_eps_high))
    return {"trained": 1.0, "train_tokens": float(sum(b.n_tokens for b in batches)), **metrics}


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


def summary(rows: list[dict], out: Path) -> str:
    k = max(1, len(rows) // 4)
    first, last = rows[:k], rows[-k:]

    def rate(rs: list[dict]) -> tuple[float, int]:
        n = sum(r["n_scored"] for r in rs)
        return sum(r["success_rate"] * r["n_scored"] for r in rs) / max(n, 1), n

    (fs, fn), (ls, ln) = rate(first), rate(last)
    return (
        f"gyre: success rate {fs:.2f} over the first {k} steps ({fn} rollouts) -> "
        f"{ls:.2f} over the last {k} steps ({ln} rollouts)\n"
        f"gyre: outputs in {out}"
    )
