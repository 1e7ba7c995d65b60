"""What the Megatron trainer does differently on CUDA: Transformer Engine layers, megatron's DDP with
the distributed optimizer. Nothing here runs on a CPU machine; the CPU trainer keeps its torch AdamW
(megatron's optimizer and grad clipping hard-code CUDA) and finishes its gradients itself
(gyre/train/model_parallel.py).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from gyre.config.schema import TrainConfig


def transformer_engine_enabled(train_cfg: TrainConfig, device: torch.device) -> bool:
    """train.transformer_engine: on (fail without it), auto (when CUDA and importable), off."""
    available = device.type == "cuda" and importlib.util.find_spec("transformer_engine") is not None
    if train_cfg.transformer_engine == "on" and not available:
        raise RuntimeError(
            "train.transformer_engine=on needs CUDA and the transformer_engine package; install it or set it to off"
        )
    return train_cfg.transformer_engine == "on" or (train_cfg.transformer_engine == "auto" and available)


@dataclass
class MegatronOptimizerStep:
    """megatron DDP (contiguous fp32 grad buffers) + megatron's optimizer with grad clipping, on CUDA.

    The model keeps its own parameters; DDP's hooks accumulate their grads into `main_grad` buffers,
    which the optimizer (distributed or not) reads, clips and applies.
    """

    ddp: Any
    optimizer: Any

    @classmethod
    def build(cls, model: torch.nn.Module, train_cfg: TrainConfig) -> MegatronOptimizerStep:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=train_cfg.distributed_optimizer,
        )
        ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=train_cfg.lr,
            weight_decay=train_cfg.weight_decay,
            adam_beta1=0.9,
            adam_beta2=train_cfg.adam_beta2,
            clip_grad=train_cfg.grad_clip if train_cfg.grad_clip > 0 else 0.0,
            bf16=False,
            fp16=False,
            params_dtype=torch.float32,
            use_distributed_optimizer=train_cfg.distributed_optimizer,
        )
        return cls(ddp, get_megatron_optimizer(opt_config, [ddp]))

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> tuple[float, bool]:
        """(grad norm before clipping, skipped); megatron skips a step whose norm is not finite."""
        # megatron's own finish: the data-parallel reduction, then the sums its layout needs beyond it: the
        # query/key norms over tensor-parallel ranks (config.qk_layernorm: each rank normalises its own heads
        # with the shared weight), the word embeddings between first and last pipeline stage when tied
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp])
        ok, grad_norm, _ = self.optimizer.step()
        return float(grad_norm if grad_norm is not None else float("nan")), not ok

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
