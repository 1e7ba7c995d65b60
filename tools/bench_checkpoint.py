"""Checkpoint benchmark: what checkpointing every step costs the step's critical path, written in the caller (sync)
and by gyre.resume.checkpoint.Checkpointer's background writer (async), measured side by side in one run.

    python -m tools.bench_checkpoint [--pairs 12] [--batch 8] [--seq 512] [--step-s S] [--metrics metrics.jsonl]
                                     [--model.hidden_size 128 ...] [--json]

The trainer is the embedded default's (MegatronTrainer on the default ModelConfig; --model.<field> to scale it)
training a synthetic batch. The unit is a pair of steps, the first followed by a checkpoint of the run's state:
none, sync or async, rotated pair by pair so that all three see the same machine. A pair's wall time holds the
train steps, the checkpoint call (for async: copying the snapshot) and whatever the background write takes from
the next step (its thread shares the cores). Cost on the critical path = median(pair with a checkpoint) -
median(pair without), reported as a fraction of a train step and, with --step-s or --metrics (a run's
metrics.jsonl: the median step wall_s), of a whole RL step (rollouts + training + weight sync): the measure that
counts, since a real step is mostly rollouts. The snapshot's own time (the caller's share) is reported too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from gyre.config.schema import ModelConfig, TrainConfig
from gyre.metrics import read_metrics
from gyre.resume.checkpoint import Checkpointer
from gyre.resume.state import RunState
from gyre.train.megatron_trainer import MegatronTrainer

MODES = ("none", "sync", "async")


class Bench:
    def __init__(self, model_cfg: ModelConfig, batch: int, seq: int, out: Path) -> None:
        self.trainer = MegatronTrainer(model_cfg, TrainConfig())
        self.tokens = torch.randint(1, model_cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
        self.state = RunState()
        self.checkpointers = {
            "sync": Checkpointer(out / "sync", asynchronous=False),
            "async": Checkpointer(out / "async", asynchronous=True),
        }
        for path in (out / "sync", out / "async"):
            path.mkdir(parents=True, exist_ok=True)

    def train(self) -> float:
        start = time.perf_counter()
        self.trainer.train_step([_Batch(self.tokens)], lambda logp, mb: (-logp.mean(), {}))
        self.state.record_step(self.state.next_step, [], [], [])
        return time.perf_counter() - start

    def pair(self, mode: str) -> dict[str, float]:
        """Train, checkpoint (mode), train: the pair's wall time, the first step's train time and the save call's."""
        start = time.perf_counter()
        train_s = self.train()
        save_s = 0.0
        if mode != "none":
            checkpointer = self.checkpointers[mode]
            checkpointer.save(self.state, self.trainer)
            save_s = checkpointer.blocking_s
        self.train()
        return {"pair_s": time.perf_counter() - start, "train_s": train_s, "save_s": save_s}

    def close(self) -> None:
        for checkpointer in self.checkpointers.values():
            checkpointer.close()


class _Batch:
    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens


def checkpoint_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in (directory / "checkpoint").rglob("*") if p.is_file())


def run(args: argparse.Namespace, model_cfg: ModelConfig) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gyre-bench-ckpt-", dir=args.dir) as tmp:
        bench = Bench(model_cfg, args.batch, args.seq, Path(tmp))
        for mode in MODES:  # warm-up: first allocations, first files, the writer thread
            bench.pair(mode)
        samples: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        for i in range(args.pairs * len(MODES)):
            mode = MODES[i % len(MODES)]
            samples[mode].append(bench.pair(mode))
        bench.close()
        size = checkpoint_bytes(Path(tmp) / "async")
        params = sum(p.numel() for p in bench.trainer.model.parameters())
    return {"params": params} | summarize(samples, size, model_cfg, args, step_seconds(args))


def step_seconds(args: argparse.Namespace) -> float | None:
    if args.step_s:
        return args.step_s
    if args.metrics:
        walls = [r["wall_s"] for r in read_metrics(args.metrics) if r.get("event", "step") == "step" and "wall_s" in r]
        return statistics.median(walls) if walls else None
    return None


def summarize(
    samples: dict[str, list[dict[str, float]]],
    size: int,
    model_cfg: ModelConfig,
    args: argparse.Namespace,
    rl_step_s: float | None,
) -> dict[str, Any]:
    def median(mode: str, key: str) -> float:
        return statistics.median(s[key] for s in samples[mode])

    train_s = statistics.median(s["train_s"] for m in MODES for s in samples[m])
    out: dict[str, Any] = {
        "model": {f.name: getattr(model_cfg, f.name) for f in fields(ModelConfig) if f.name.endswith("size")},
        "checkpoint_mb": round(size / 2**20, 2),
        "pairs_per_mode": args.pairs,
        "train_step_s": round(train_s, 4),
        "rl_step_s": rl_step_s,
    }
    for mode in ("sync", "async"):
        cost = median(mode, "pair_s") - median("none", "pair_s")
        out[mode] = {
            "save_call_s": round(median(mode, "save_s"), 4),
            "critical_path_s": round(cost, 4),
            "of_train_step": round(cost / train_s, 4),
            "of_rl_step": round(cost / rl_step_s, 5) if rl_step_s else None,
        }
    return out


def parse() -> tuple[argparse.Namespace, ModelConfig]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=12, help="pairs of steps per mode")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--step-s", type=float, default=0.0, help="a whole RL step's seconds, to report the fraction of")
    p.add_argument("--metrics", type=Path, help="a run's metrics.jsonl: its median step wall_s is the RL step")
    p.add_argument("--dir", default=None, help="where the checkpoints are written (default: the temp dir)")
    p.add_argument("--json", action="store_true")
    numbers = {"int": int, "float": float}
    for f in fields(ModelConfig):
        if f.type in numbers:
            p.add_argument(f"--model.{f.name}", dest=f"model_{f.name}", type=numbers[f.type], default=None)
    args = p.parse_args()
    overrides = {
        f.name: getattr(args, f"model_{f.name}") for f in fields(ModelConfig) if hasattr(args, f"model_{f.name}")
    }
    return args, ModelConfig(**{k: v for k, v in overrides.items() if v is not None})


def main() -> None:
    args, model_cfg = parse()
    result = run(args, model_cfg)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"model {result['model']}, checkpoint {result['checkpoint_mb']} MB, train step {result['train_step_s']} s"
          + (f", RL step {result['rl_step_s']:.2f} s" if result["rl_step_s"] else ""))  # fmt: skip
    for mode in ("sync", "async"):
        r = result[mode]
        rl = f", {100 * r['of_rl_step']:.3f}% of an RL step" if r["of_rl_step"] is not None else ""
        print(f"{mode:>5}: save call {r['save_call_s'] * 1e3:.1f} ms, critical path {r['critical_path_s'] * 1e3:.1f} ms "
              f"= {100 * r['of_train_step']:.2f}% of a train step{rl}")  # fmt: skip


if __name__ == "__main__":
    main()
