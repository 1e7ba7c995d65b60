"""One training replica's side of streaming training: micro-batches from shards, gradients as one flat
fp32 vector, and the core's step over the sum.

Every replica trains its micro-batches with a rollout scale of 1 and accumulates gradients; the core
sums the replicas' gradients and multiplies by 1 / |R| (gyre.pipeline.loss_rollouts), which is exactly
the gradient of GSPO's per-step mean (the loss is linear in the scale), known only once the last
group is in. The core then clips and steps as a single replica would.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gyre.comm.messages import MicroBatchRef
from gyre.config.schema import RunConfig
from gyre.pipeline import RLMicroBatch, loss_rollouts, rl_micro_batches, with_signal
from gyre.store.reader import ShardRollout, read_shard

if TYPE_CHECKING:  # the controller plans micro-batches without importing megatron
    from gyre.train.trainer import Trainer


def group_micro_batches(shard: Path | str, cfg: RunConfig) -> list[RLMicroBatch]:
    """A group shard's trainable rollouts packed into micro-batches (deterministic: every cell packs alike)."""
    return _pack(with_signal(read_shard(shard).trainable()), cfg)


def _pack(rollouts: list[ShardRollout], cfg: RunConfig) -> list[RLMicroBatch]:
    return rl_micro_batches(
        rollouts, cfg.train.micro_batch_tokens, cfg.model.max_position_embeddings, 1, cfg.rl.logprob_distribution
    )


def plan_group(shard: Path | str, cfg: RunConfig) -> tuple[list[MicroBatchRef], list[str], int]:
    """The micro-batches of one group shard, the ids of the rollouts they train, and how many of the
    group's rollouts the step's loss is averaged over (gyre.pipeline.loss_rollouts, by rl.loss_norm)."""
    candidates = list(read_shard(shard).trainable())
    batches = _pack(with_signal(candidates), cfg)
    refs = [MicroBatchRef(str(shard), i, b.n_tokens) for i, b in enumerate(batches)]
    trained = list(dict.fromkeys(rid for b in batches for rid in b.batch.rollout_ids))
    return refs, trained, loss_rollouts(candidates, cfg.rl.loss_norm)


class MicroBatchSource:
    """Resolves MicroBatchRefs, packing each shard once."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self._packed: dict[str, list[RLMicroBatch]] = {}

    def get(self, ref: MicroBatchRef) -> RLMicroBatch:
        if ref.shard not in self._packed:
            self._packed[ref.shard] = group_micro_batches(ref.shard, self.cfg)
        batches = self._packed[ref.shard]
        if not 0 <= ref.index < len(batches):
            raise IndexError(f"{ref.shard} packs into {len(batches)} micro-batches; there is no {ref.index}")
        return batches[ref.index]

    def forget(self, shards: Sequence[str]) -> None:
        for s in shards:
            self._packed.pop(s, None)


def param_grad(p: torch.nn.Parameter) -> torch.Tensor | None:
    """A parameter's accumulated gradient: megatron's DDP (the GPU trainer) keeps it in the contiguous buffer
    behind `main_grad`, torch's optimizer (the CPU trainer) in `.grad`."""
    return p.main_grad if hasattr(p, "main_grad") else p.grad


def flat_grads(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(all parameters' gradients as one fp32 vector in host memory, for MPI; uint8 [n_params] 1 where a
    parameter has a gradient)."""
    params = list(model.parameters())
    grads = [param_grad(p) for p in params]
    has = torch.tensor([g is not None for g in grads], dtype=torch.uint8)
    parts = [
        (g if g is not None else torch.zeros_like(p)).detach().float().reshape(-1)
        for p, g in zip(params, grads, strict=True)
    ]
    return torch.cat(parts).cpu() if parts else torch.zeros(0), has


def grad_numel(model: torch.nn.Module) -> tuple[int, int]:
    params = list(model.parameters())
    return sum(p.numel() for p in params), len(params)


def set_flat_grads(model: torch.nn.Module, flat: torch.Tensor, has: torch.Tensor) -> None:
    """Make `flat` the gradients; parameters no replica gave a gradient keep none (the optimizer skips them),
    or zeros in megatron's DDP buffer, which its optimizer reads whole."""
    offset = 0
    for p, keep in zip(model.parameters(), has.tolist(), strict=True):
        n = p.numel()
        part = flat[offset : offset + n].view_as(p)
        if hasattr(p, "main_grad"):
            p.main_grad.copy_(part if keep else torch.zeros_like(part))
        else:
            p.grad = part.to(device=p.device, dtype=p.dtype).clone() if keep else None
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flat gradient has {flat.numel()} values, the model {offset}")


def core_step(trainer: Trainer, summed: torch.Tensor, has: torch.Tensor, scale: float) -> dict[str, float]:
    """Install the summed gradients times `scale` on the core and take the optimizer step (clip included)."""
    if not bool(has.any()):
        trainer.zero_grad()
        return {"skipped_step": 1.0, "grad_norm": 0.0, "lr": trainer.lr}
    set_flat_grads(trainer.model, summed * scale, has)
    return trainer.optimizer_step()
