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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gyre.config.schema import ModelConfig, TrainConfig
from gyre.model.moe import moe_layer_indices
from gyre.model.weights import hf_to_megatron, megatron_to_hf
from gyre.train.chunked_logprobs import TargetLogprobs, hidden_states
from gyre.train.dist_checkpoint import (
    METADATA,
    SnapshotWriter,
    architecture,
    is_dcp_checkpoint,
    load_sharded,
    save_sharded,
    sharded_items,
)
from gyre.train.logprobs import target_logprobs
from gyre.train.megatron_cuda import MegatronOptimizerStep, transformer_engine_enabled
from gyre.train.megatron_gpt import build_gpt_model, parallel_state
from gyre.train.model_parallel import clip_gradients, finish_gradients, init_model_parallel, needs_model_parallel
from gyre.train.pipeline_schedule import pipeline_step
from gyre.train.routing_replay import padded_order, replaying
from gyre.train.sampling_logprobs import sampled_token_logprobs
from gyre.train.shard_weights import (
    expert_parallel_rank_size,
    gather_shards,
    gather_state,
    shard_state,
    stage_layers,
)
from gyre.train.split_tree import split_forward_backward, split_logprobs
from gyre.train.tree_attention_megatron import accepts_tree_plans
from gyre.train.tree_pack import SplitTreeBatch, TreeMicroBatch

LossFn = Callable[[torch.Tensor, Any], tuple[torch.Tensor, dict[str, float]]]


def causal_mask(seq_len: int) -> torch.Tensor:
    """[1, 1, T, T] bool, True = masked (megatron's convention, the inverse of llama.py's)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]


@dataclass
class PaddedBatch:
    tokens: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor | None = None  # [B or 1, 1, T, T] bool, True = masked; causal when None


class MegatronTrainer:
    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig) -> None:
        torch.set_num_threads(train_cfg.num_threads)
        self.model_cfg = model_cfg
        self.train_cfg = train_cfg
        # The CPU shim only applies without CUDA; with CUDA megatron's layers expect CUDA tensors.
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        init_model_parallel(train_cfg, model_cfg)  # over the launcher's world, or a one-process one
        self.parallel = torch.distributed.get_world_size() > 1  # shards, stages or data-parallel replicas
        self.pipelined = parallel_state.get_pipeline_model_parallel_world_size() > 1
        use_te = transformer_engine_enabled(train_cfg, self.device) and not model_cfg.num_experts  # local MoE spec
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
        self._grads_finished = False

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def logits(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] -> fp32 logits [B, T, V]. attention_mask [B or 1, 1, T, T] bool, True = masked;
        causal when None. With pipeline stages every stage gets the last stage's logits, without gradient."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        mb = PaddedBatch(tokens, attention_mask)
        if self.pipelined:
            return self._pipelined_outputs(mb, lambda out, _: out.float())
        return self._stage_forward(mb).float()

    def token_logprobs(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """log p(tokens[:, t+1] | tokens[:, :t+1]) as [B, T-1] fp32, under the current weights.

        Differentiable (except with pipeline stages); wrap in torch.no_grad() for behaviour/reference
        logprobs. Right padding leaves the real tokens' logprobs unchanged (causal attention); callers
        ignore the pad positions.
        """
        return self.micro_batch_logprobs(PaddedBatch(tokens, attention_mask))

    def tree_token_logprobs(self, batch: TreeMicroBatch) -> torch.Tensor:
        """log p(token i | its root path) for every packed token as [N] fp32 (0 at roots), read from the logits
        at parent[i], under the distribution token i's call sampled from (batch.sampling: temperature, ...).
        Differentiable (except with pipeline stages); equals running each root-to-leaf path as a plain sequence."""
        return self.micro_batch_logprobs(batch)

    def _stage_forward(self, mb: Any) -> torch.Tensor:
        """This rank's stage of the model on a micro-batch: the logits on the last stage, else its hidden states."""
        tree = getattr(mb, "batch", mb)
        if isinstance(tree, TreeMicroBatch):
            self._check_tree_spec()
            with replaying(self.model, self._stage_routing(tree.routed_experts)):
                return self.model(tree.tokens.to(self.device), None, tree.attention.to(self.device))
        tokens = mb.tokens
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        mask = getattr(mb, "attention_mask", None)
        mask = causal_mask(tokens.shape[1]) if mask is None else mask
        routed = getattr(mb, "routed_experts", None)  # [B, T, L, k]
        with replaying(self.model, None if routed is None else self._stage_routing(padded_order(routed))):
            return self.model(tokens.to(self.device), None, mask.to(self.device))

    def _stage_routing(self, routed: torch.Tensor | None) -> torch.Tensor | None:
        """The replayed experts [N, L, k] of this pipeline stage's MoE layers (all of them without stages)."""
        if routed is None or not self.pipelined:
            return routed
        layers = stage_layers(self.model_cfg, *self.layout[2:])
        return routed[:, [j for j, i in enumerate(moe_layer_indices(self.model_cfg)) if i in layers]]

    def _logprobs_of(self, logits: torch.Tensor, mb: Any) -> torch.Tensor:
        tree = getattr(mb, "batch", mb)
        tokens = tree.tokens.to(self.device)
        if not isinstance(tree, TreeMicroBatch):
            return target_logprobs(logits.float()[:, :-1], tokens[:, 1:])
        parent = tree.parent.to(self.device)
        rows = logits.float()[0][parent.clamp(min=0)]  # [N, V]
        logp = sampled_token_logprobs(rows, tokens[0], tree.sampling.to(self.device))
        return torch.where(parent >= 0, logp, torch.zeros_like(logp))

    def _pipelined_outputs(self, mb: Any, read: Callable[[torch.Tensor, Any], torch.Tensor]) -> torch.Tensor:
        if isinstance(getattr(mb, "batch", mb), SplitTreeBatch):
            raise ValueError(self._NO_SPLIT_PIPELINE)
        with torch.no_grad():
            [out] = pipeline_step(self.model, [mb], self._stage_forward, lambda o, m: (None, read(o, m).cpu()),
                                  self.device, backward=False)  # fmt: skip
        return out.to(self.device)

    _NO_SPLIT_PIPELINE = (
        "trees over train.micro_batch_tokens are trained in segments, which do not run over pipeline stages yet: "
        "set train.pipeline_parallel=1 or raise train.micro_batch_tokens"
    )

    def _check_tree_spec(self) -> None:
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
            if self.pipelined:
                raise ValueError(self._NO_SPLIT_PIPELINE)
            return split_logprobs(self.model, tree, self.device)
        if self.pipelined:
            return self._pipelined_outputs(mb, self._logprobs_of)
        if isinstance(tree, TreeMicroBatch):
            return self._tree_logprobs(tree)
        return self._logprobs_of(self._stage_forward(mb), mb)

    def _tree_logprobs(self, tree: TreeMicroBatch) -> torch.Tensor:
        """[N] logprobs of a tree micro-batch on one stage, its logits made in row chunks (no [N, V] tensor):
        the same values as _logprobs_of on the logits (gyre/train/chunked_logprobs.py)."""
        head = TargetLogprobs(self.model)
        with hidden_states(self.model):
            hidden = self._stage_forward(tree)[:, 0]  # [N, 1, H] -> [N, H]
        parent, tokens = tree.parent.to(self.device), tree.tokens[0].to(self.device)
        t = torch.nonzero(parent >= 0).squeeze(-1)
        logp_t = head(hidden, parent[t], tokens[t], tree.sampling.to(self.device).take(t))
        return hidden.new_zeros(tokens.shape[0], dtype=torch.float32).index_put((t,), logp_t)

    def _finish_gradients(self) -> None:
        """Once per step: the data-parallel sum and the tensor-parallel sums (gyre.train.model_parallel)."""
        if not self._grads_finished:
            finish_gradients(self.model)
            self._grads_finished = True

    def gradients_hf(self) -> dict[str, torch.Tensor]:
        """The step's accumulated gradients of the whole model, before clipping, in HF names (a check of the
        model-parallel layout against one process; every rank of the replica takes part)."""
        if self.parallel:
            self._finish_gradients()
        grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in self.model.named_parameters()}
        if self.parallel:
            grads = gather_shards(grads, self.model_cfg)
        return {k: v.clone() for k, v in megatron_to_hf(grads, self.model_cfg).items()}

    def zero_grad(self) -> None:
        self._grads_finished = False
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
        if getattr(loss_fn, "needs_proximal", False):
            self.attach_proximal(micro_batches)
        sums: dict[str, float] = defaultdict(float)
        if self.pipelined:
            for metrics in self._pipelined_forward_backward(micro_batches, loss_fn):
                for name, value in metrics.items():
                    sums[name] += value
            return {name: total / len(micro_batches) for name, total in sums.items()}
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

    def attach_proximal(self, micro_batches: Sequence[Any]) -> None:
        """rl.mismatch.proximal=trainer: each micro-batch's `proximal`, the logprobs of its tokens under the weights
        before this step's update (no gradient, the same forward as training's), GSPO's old policy."""
        with torch.no_grad():
            for mb in micro_batches:
                mb.proximal = self.micro_batch_logprobs(mb).detach()

    def _pipelined_forward_backward(self, micro_batches: Sequence[Any], loss_fn: LossFn) -> list[dict[str, float]]:
        if any(isinstance(getattr(mb, "batch", mb), SplitTreeBatch) for mb in micro_batches):
            raise ValueError(self._NO_SPLIT_PIPELINE)

        def last_stage(logits: torch.Tensor, mb: Any) -> tuple[torch.Tensor, dict[str, float]]:
            loss, metrics = loss_fn(self._logprobs_of(logits, mb), mb)
            return loss, {name: float(value) for name, value in metrics.items()}

        return pipeline_step(self.model, micro_batches, self._stage_forward, last_stage, self.device)

    def optimizer_step(self) -> dict[str, float]:
        """Clip the accumulated gradients to train_cfg.grad_clip and step; a non-finite norm skips the step."""
        if self._mcore is not None:
            grad_norm, skipped = self._mcore.step()
            self.step += int(not skipped)
            self.zero_grad()
            return {"grad_norm": grad_norm, "lr": self.lr, "skipped_step": float(skipped)}
        max_norm = self.train_cfg.grad_clip if self.train_cfg.grad_clip > 0 else math.inf
        if self.parallel:  # the step's gradients on every rank, then the norm over all the model's shards
            self._finish_gradients()
            grad_norm = clip_gradients(self.model, max_norm)
        else:
            params = [p for p in self.model.parameters() if p.grad is not None]
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
        """A snapshot of the whole model's weights in HF names and layout (cloned: training may continue).
        With model parallelism every rank of the replica's model-parallel group takes part (a gather)."""
        state = gather_state(self.model, self.model_cfg) if self.parallel else self.model.state_dict()
        return {k: v.clone() for k, v in megatron_to_hf(state, self.model_cfg).items()}

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load the whole model's HF-named weights; each rank keeps its shard. The optimizer state is left as it is."""
        local = hf_to_megatron(state, self.model_cfg)
        if self.parallel:
            local = shard_state(local, self.model_cfg, *self.layout, *expert_parallel_rank_size())
        result = self.model.load_state_dict(local, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
        if missing or result.unexpected_keys:
            raise KeyError(
                f"GPTModel rejected converted weights: missing {missing}, unexpected {result.unexpected_keys}"
            )

    @property
    def layout(self) -> tuple[int, int, int, int]:
        """(tensor-parallel rank, size, pipeline rank, size) of this rank."""
        return (
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )

    def save(self, path: str | os.PathLike) -> None:
        """Model, optimizer state and step counter into the directory `path`. Every rank of the trainer world
        calls it. On CPU (torch AdamW) a torch.distributed.checkpoint that any layout loads (see
        gyre.train.dist_checkpoint); with megatron's CUDA optimizer one file per rank, `rank{r}.pt`, which
        only the same layout loads."""
        path = Path(path)
        if self._mcore is None:
            save_sharded(path, self.model, self.optimizer, self.model_cfg, self.step)
            return
        path.mkdir(parents=True, exist_ok=True)
        weights = {k: v for k, v in self.model.state_dict().items() if not k.endswith("._extra_state")}
        payload = {
            "model": weights,
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "model_config": asdict(self.model_cfg),
            "layout": list(self.layout),
        }
        target = path / f"rank{torch.distributed.get_rank() if self.parallel else 0}.pt"
        tmp = target.with_name(target.name + ".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, target)
        if self.parallel:  # every shard is in place before the caller moves the checkpoint into place
            torch.distributed.barrier()

    @property
    def snapshots(self) -> bool:
        """Whether snapshot() copies the checkpoint (the sharded format of torch's AdamW) rather than give None."""
        return self._mcore is None

    def snapshot(self) -> SnapshotWriter | None:
        """What save() would write, copied now, to write later on another thread (gyre.resume.checkpoint's
        background writer); None with megatron's CUDA optimizer, whose per-rank files are saved in place."""
        if not self.snapshots:
            return None
        return SnapshotWriter(sharded_items(self.model, self.optimizer, self.model_cfg, self.step, copy=True))

    def load(self, path: str | os.PathLike) -> None:
        """Restore what save() wrote; the checkpoint must come from the same model architecture. A sharded
        checkpoint loads into any layout; the per-rank files of megatron's CUDA optimizer into their own."""
        path = Path(path)
        if is_dcp_checkpoint(path):
            if self._mcore is not None:
                raise ValueError(
                    f"checkpoint {path} holds torch AdamW's state (a CPU run); megatron's CUDA optimizer cannot "
                    "load it: resume it on CPU, or start the CUDA run from its weights (model.path)"
                )
            self.step = load_sharded(path, self.model, self.optimizer, self.model_cfg)
            return
        rank = torch.distributed.get_rank() if self.parallel else 0
        # a directory of megatron's per-rank files, or (checkpoints of gyre before the sharded format)
        # trainer.pt with trainer.pt.rank{r} beside it
        rank_file = (
            path / f"rank{rank}.pt" if path.is_dir() else path.with_name(path.name + f".rank{rank}" * (rank > 0))
        )
        if not rank_file.exists():
            raise FileNotFoundError(f"{path} holds no trainer checkpoint (neither {METADATA} nor {rank_file.name})")
        payload = torch.load(rank_file, map_location="cpu", weights_only=True)
        layout = list(payload.get("layout", [0, 1, 0, 1]))
        if layout != list(self.layout):
            raise ValueError(
                f"checkpoint {path} holds the shard (tensor rank, size, pipeline rank, size) = {layout}, this rank "
                f"is {list(self.layout)}: megatron's CUDA optimizer state resumes only with the "
                "train.tensor_parallel and pipeline_parallel it was written with"
            )
        if architecture(payload["model_config"]) != architecture(asdict(self.model_cfg)):
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
