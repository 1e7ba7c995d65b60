"""`mpirun -n W python -m mpi4py tests/model_parallel_job.py OUT TP PP`: one optimizer update of the
Megatron trainer over a W-rank gloo world with train.tensor_parallel=TP, pipeline_parallel=PP and data
parallel over the rest; data-parallel replica d trains micro-batches d, d + DP, ... of the step.
Rank 0 writes the whole model's gradients and weights after the update (gathered, HF names), the
step's metrics and
the logprobs of one micro-batch before the update to OUT (torch.save).

`one_step(trainer, micro_batches)` is the same step, which the test also runs in one process."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gyre.config.schema import ModelConfig, TrainConfig
from gyre.model.random_model import random_hf_state
from gyre.train.tree_pack import TreeMicroBatch, pack_forest
from gyre.traj.tree import TrajectoryTree

CFG = ModelConfig(
    vocab_size=64,
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=96,
    qk_layernorm=True,  # Qwen3's per-head norms: their gradient is a sum over tensor-parallel ranks
)
N_MICRO_BATCHES = 4


def train_config(tp: int = 1, pp: int = 1) -> TrainConfig:
    # clipping at 0.5 is active (the norm is above it): the norm must be the whole model's
    return TrainConfig(lr=1e-3, grad_clip=0.5, num_threads=1, tensor_parallel=tp, pipeline_parallel=pp)


def initial_weights() -> dict[str, torch.Tensor]:
    state = random_hf_state(CFG, seed=5)
    gen = torch.Generator().manual_seed(6)  # norms away from one, so that their gradients matter
    return {
        k: v + 0.1 * torch.randn(v.shape, generator=gen) if k.endswith("norm.weight") else v for k, v in state.items()
    }


@dataclass
class Padded:
    tokens: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T-1]


def _tree(rng: np.random.Generator, n: int) -> TrajectoryTree:
    parent = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], np.int32)
    depth = np.zeros(n, np.int32)
    for i in range(1, n):
        depth[i] = depth[parent[i]] + 1
    tokens = rng.integers(0, CFG.vocab_size, n).astype(np.int32)
    policy = (rng.random(n) < 0.7) & (parent >= 0)
    return TrajectoryTree(
        f"t{n}", tokens, parent, depth, policy, np.zeros(n, np.float32), np.full(n, -1), np.zeros(n, np.uint8)
    )


def micro_batches() -> list[Any]:
    """Two padded batches and two packed trees (tree attention under the shards), in step order."""
    gen = torch.Generator().manual_seed(3)
    rng = np.random.default_rng(4)
    padded = [
        Padded(torch.randint(0, CFG.vocab_size, (2, 10 + k), generator=gen), torch.ones(2, 9 + k)) for k in (0, 3)
    ]
    trees = [pack_forest([_tree(rng, 14), _tree(rng, 9)]), pack_forest([_tree(rng, 17)])]
    return [padded[0], trees[0], padded[1], trees[1]]


def loss_fn(logp: torch.Tensor, mb: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """Each micro-batch's mean negative logprob, scaled for its share of the step."""
    if isinstance(mb, TreeMicroBatch):
        w = mb.loss_weight.to(logp.device)
        nll = -(logp * w).sum() / w.sum()
    else:
        nll = -(logp * mb.mask).sum() / mb.mask.sum()
    return nll / N_MICRO_BATCHES, {"nll": float(nll.detach())}


def one_step(trainer: Any, batches: list[Any]) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """train_step, reading the step's gradients (whole model, HF names) before the update."""
    trainer.zero_grad()
    metrics = trainer.forward_backward(batches, loss_fn)
    grads = trainer.gradients_hf()
    return metrics | trainer.optimizer_step(), grads


def main(out: Path, tp: int, pp: int) -> None:
    from mpi4py import MPI

    from gyre.comm.gloo_transport import init_gloo_from_mpi
    from gyre.train.megatron_gpt import parallel_state
    from gyre.train.megatron_trainer import MegatronTrainer

    init_gloo_from_mpi(MPI.COMM_WORLD)
    trainer = MegatronTrainer(CFG, train_config(tp, pp))
    trainer.load_hf_state_dict(initial_weights())
    batches = micro_batches()
    with torch.no_grad():
        before = trainer.micro_batch_logprobs(batches[1])
    dp, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    metrics, grads = one_step(trainer, batches[dp::dp_size])
    after = trainer.hf_state_dict()
    # what this rank would send an SGLang engine shard to shard: its stage, TP shards all-gathered, in HF names
    from gyre.engine.sglang_weights import sends_weights, stage_hf_state, tp_merged_stage

    stage = stage_hf_state(tp_merged_stage(trainer.model, CFG), CFG)
    sender = sends_weights(parallel_state.get_tensor_model_parallel_rank())
    stages = MPI.COMM_WORLD.gather((sender, stage), root=0)
    if MPI.COMM_WORLD.Get_rank() == 0:
        layout = {"tp": tp, "pp": pp, "dp": dp_size}
        torch.save({"weights": after, "grads": grads, "metrics": metrics, "logprobs": before, "layout": layout,
                    "stages": stages}, out)  # fmt: skip
    MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
