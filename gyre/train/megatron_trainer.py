"""A single training replica: megatron-core GPTModel plus a torch AdamW optimizer.

megatron's own optimizer and grad clipping hard-code CUDA, so the optimizer is torch's; the model,
its layers and its parameter layout are megatron-core's. Weights leave and enter in the HF layout of
gyre/model/llama.py (see gyre/model/weights.py), which is what the rollout engines serve.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from gyre.config.schema import ModelConfig, TrainConfig
from gyre.config.validate import check_train
from gyre.model.megatron_gpt import build_gpt_model
from gyre.model.weights import hf_to_megatron, megatron_to_hf
from gyre.train.logprobs import target_logprobs
from gyre.train.megatron_cuda import (
    MegatronOptimizerStep,
    init_model_parallel,
    needs_model_parallel,
    transformer_engine_enabled,
)
from gyre.train.sampling_logprobs import sampled_token_logprobs
from gyre.train.split_tree import split_forward_backward, split_logprobs
from gyre.train.tree_attention_megatron import accepts_tree_plans
from gyre.train.tree_pack import SplitTreeBatch, TreeMicroBatch

LossFn = Callable[[torch.Tensor, Any], tuple[torch.Tensor, dict[str, float]]]


def causal_mask(seq_len: int) -> torch.Tensor:
    """[1, 1, T, T] bool, True = masked (megatron's convention, the inverse of llama.py's)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]


def _architecture(model_config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in model_config.items() if k not in ("seed", "init_std")}


class MegatronTrainer:
    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig) -> None:
        torch.set_num_threads(train_cfg.num_threads)
        self.model_cfg = model_cfg
        self.train_cfg = train_cfg
        # The CPU shim only applies without CUDA; with CUDA megatron's layers expect CUDA tensors.
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        check_train(train_cfg, model_cfg)
        if needs_model_parallel(train_cfg):  # CUDA only; raises with what to do on CPU
            init_model_parallel(train_cfg, model_cfg)
        use_te = transformer_engine_enabled(train_cfg, self.device)
        self.model = build_gpt_model(model_cfg, transformer_engine=use_te).to(self.device)
        # CUDA: megatron's DDP and optimizer (distributed when train.distributed_optimizer); CPU: torch AdamW.
        self._mcore: MegatronOptimizerStep | None = None
        if self.device.type == "cuda" and (train_cfg.distributed_optimizer or needs_model_parallel(train_cfg)):
            self._mcore = MegatronOptimizerStep.build(self.model, train_cfg)
        self.optimizer: Any = self._mcore or torch.optim.AdamW(
            self.model.parameters(),
            lr=train_cfg.lr,
            betas=(0.9, train_cfg.adam_beta2),
            weight_decay=train_cfg.weight_decay,
        )
        self.step = 0

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def logits(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] -> fp32 logits [B, T, V]. attention_mask [B or 1, 1, T, T] bool, True = masked;
        causal when None."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        if attention_mask is None:
            attention_mask = causal_mask(tokens.shape[1])
        return self.model(tokens.to(self.device), None, attention_mask.to(self.device)).float()

    def token_logprobs(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """log p(tokens[:, t+1] | tokens[:, :t+1]) as [B, T-1] fp32, under the current weights.

        Differentiable; wrap in torch.no_grad() for behaviour/reference logprobs. Right padding leaves
        the real tokens' logprobs unchanged (causal attention); callers ignore the pad positions.
        """
        tokens = tokens.to(self.device)
        return target_logprobs(self.logits(tokens, attention_mask)[:, :-1], tokens[:, 1:])

    def tree_token_logprobs(self, batch: TreeMicroBatch) -> torch.Tensor:
        """log p(token i | its root path) for every packed token as [N] fp32 (0 at roots), read from the logits
        at parent[i], under the distribution token i's call sampled from (batch.sampling: temperature, ...).
        Differentiable; equals running each root-to-leaf path as a plain sequence."""
        self._check_tree_spec()
        tokens = batch.tokens.to(self.device)
        logits = self.model(tokens, None, batch.attention.to(self.device)).float()[0]  # [N, V]
        parent = batch.parent.to(self.device)
        rows = logits[parent.clamp(min=0)]
        logp = sampled_token_logprobs(rows, tokens[0], batch.sampling.to(self.device))
        return torch.where(parent >= 0, logp, torch.zeros_like(logp))

    def _check_tree_spec(self) -> None:
        if self.train_cfg.context_parallel > 1:  # each rank would run the whole tree: no split of its tokens yet
            raise ValueError(
                "tree micro-batches are not split over context-parallel ranks yet; set train.context_parallel=1 "
                "(trees over train.micro_batch_tokens are trained in segments instead)"
            )
        if not accepts_tree_plans(self.model):
            raise ValueError(
                "tree micro-batches need the tree-aware local layer spec; this model was built with another "
                "(Transformer Engine's): set train.transformer_engine=off to train on trees"
            )

    def micro_batch_logprobs(self, mb: Any) -> torch.Tensor:
        """[N] per-token logprobs of a TreeMicroBatch or SplitTreeBatch (no gradient for the latter), or [B, T-1]
        of a padded batch (`.tokens`, `.attention_mask`)."""
        tree = getattr(mb, "batch", mb)  # RL micro-batches wrap a TreeMicroBatch with per-tree advantages
        if isinstance(tree, SplitTreeBatch):
            self._check_tree_spec()
            return split_logprobs(self.model, tree, self.device)
        if isinstance(tree, TreeMicroBatch):
            return self.tree_token_logprobs(tree)
        return self.token_logprobs(mb.tokens, getattr(mb, "attention_mask", None))

    def zero_grad(self) -> None:
        if self._mcore is not None:
            self._mcore.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(self, micro_batches: Sequence[Any], loss_fn: LossFn) -> dict[str, float]:
        """Accumulate gradients of each micro-batch's loss (already scaled for its share of the step).

        Returns the loss_fn metrics averaged over the micro-batches.
        """
        if not micro_batches:
            raise ValueError("forward_backward needs at least one micro-batch")
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        for mb in micro_batches:
            tree = getattr(mb, "batch", mb)
            if isinstance(tree, SplitTreeBatch):  # over the budget: exact, in segments
                self._check_tree_spec()
                metrics = split_forward_backward(self.model, tree, mb, loss_fn, self.device)
            else:
                logp = self.micro_batch_logprobs(mb)
                loss, metrics = loss_fn(logp, mb)
                loss.backward()
            for name, value in metrics.items():
                sums[name] += float(value)
        return {name: total / len(micro_batches) for name, total in sums.items()}

    def optimizer_step(self) -> dict[str, float]:
        """Clip the accumulated gradients to train_cfg.grad_clip and step; a non-finite norm skips the step."""
        if self._mcore is not None:
            grad_norm, skipped = self._mcore.step()
            self.step += int(not skipped)
            self.zero_grad()
            return {"grad_norm": grad_norm, "lr": self.lr, "skipped_step": float(skipped)}
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.train_cfg.grad_clip if self.train_cfg.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
            self.step += 1
        self.zero_grad()
        return {"grad_norm": grad_norm, "lr": self.lr, "skipped_step": float(skipped)}

    def train_step(self, micro_batches: Sequence[Any], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over the micro-batches: each with a `.tokens` LongTensor [B, T] and, optionally,
        an `.attention_mask` [B, 1, T, T], True = masked, e.g. for packed sequences; or a TreeMicroBatch, whose
        loss_fn gets [N] per-token logprobs (gyre.train.tree_pack.weighted_token_loss weights them)."""
        self.zero_grad()
        metrics = self.forward_backward(micro_batches, loss_fn)
        return metrics | self.optimizer_step()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """A snapshot of the weights in HF names and layout (cloned: training may continue)."""
        if self.train_cfg.tensor_parallel > 1 or self.train_cfg.pipeline_parallel > 1:
            raise NotImplementedError(
                "HF export of tensor/pipeline-sharded weights needs a gather across model-parallel ranks, which "
                "this trainer does not do yet; sync weights with train.tensor_parallel=pipeline_parallel=1"
            )
        return {k: v.clone() for k, v in megatron_to_hf(self.model.state_dict(), self.model_cfg).items()}

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights into the model. The optimizer state is left as it is."""
        result = self.model.load_state_dict(hf_to_megatron(state, self.model_cfg), strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
        if missing or result.unexpected_keys:
            raise KeyError(
                f"GPTModel rejected converted weights: missing {missing}, unexpected {result.unexpected_keys}"
            )

    def save(self, path: str | os.PathLike) -> None:
        """Model, optimizer and step counter in one torch.save file, written atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        weights = {k: v for k, v in self.model.state_dict().items() if not k.endswith("._extra_state")}
        payload = {
            "model": weights,
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "model_config": asdict(self.model_cfg),
        }
        tmp = path.with_name(path.name + ".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, path)

    def load(self, path: str | os.PathLike) -> None:
        """Restore what save() wrote; the checkpoint must come from the same ModelConfig."""
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if _architecture(payload["model_config"]) != _architecture(asdict(self.model_cfg)):
            raise ValueError(
                f"checkpoint {path} was written for model config {payload['model_config']}, "
                f"this trainer has {asdict(self.model_cfg)}; build the trainer from the checkpoint's config"
            )
        result = self.model.load_state_dict(payload["model"], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
        if missing or result.unexpected_keys:
            raise KeyError(
                f"checkpoint {path} does not fit the model: missing {missing}, unexpected {result.unexpected_keys}"
            )
        self.optimizer.load_state_dict(payload["optimizer"])
        self.step = int(payload["step"])
