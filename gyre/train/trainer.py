"""What the loops need of a training replica, and the one place a backend is chosen (`train.backend`).

The controller's cells (gyre/sched) and the warm start see a `Trainer`: they step it, read logprobs, move
weights in and out in HF names (what the rollout engines serve) and save/load it. MegatronTrainer
(gyre/train/megatron_trainer.py) is the implementation; another backend joins by adding a branch to
`make_trainer` and a value to `TrainBackend`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from gyre.config.schema import ModelConfig, TrainBackend, TrainConfig

if TYPE_CHECKING:
    import torch

LossFn = Callable[["torch.Tensor", Any], tuple["torch.Tensor", dict[str, float]]]


@runtime_checkable
class Trainer(Protocol):
    """One training replica: the model's weights, its optimizer state and its step counter."""

    model_cfg: ModelConfig
    step: int  # optimizer steps taken (not counting skipped ones)
    model: torch.nn.Module  # the replica's module (its gradients are exchanged between cells)

    @property
    def lr(self) -> float: ...

    def set_lr(self, lr: float) -> None: ...

    def train_step(self, micro_batches: Sequence[Any], loss_fn: LossFn) -> dict[str, float]:
        """zero_grad, forward_backward over the micro-batches, optimizer_step; the metrics of both."""
        ...

    def forward_backward(self, micro_batches: Sequence[Any], loss_fn: LossFn) -> dict[str, float]: ...

    def optimizer_step(self) -> dict[str, float]: ...

    def zero_grad(self) -> None: ...

    def micro_batch_logprobs(self, mb: Any) -> torch.Tensor:
        """Per-token logprobs of a tree micro-batch ([N]) or a padded batch ([B, T-1])."""
        ...

    def token_logprobs(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor: ...

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights in HF names and layout (a copy)."""
        ...

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def save(self, path: str | os.PathLike) -> None:
        """Model, optimizer state and step counter into the directory `path`."""
        ...

    def load(self, path: str | os.PathLike) -> None: ...


def make_trainer(model_cfg: ModelConfig, train_cfg: TrainConfig) -> Trainer:
    """The replica `train.backend` names. The config was checked at load (gyre.config.validate.check_run)."""
    if train_cfg.backend == TrainBackend.megatron:
        from gyre.train.megatron_trainer import MegatronTrainer  # torch and megatron load only here

        return MegatronTrainer(model_cfg, train_cfg)
    raise ValueError(f"train.backend={train_cfg.backend!r} has no trainer")
