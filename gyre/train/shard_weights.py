"""Whole-model megatron state_dicts <-> the shard one tensor-parallel rank of one pipeline stage holds.

The whole-model side is gyre.model.weights' megatron layout (HF names go through megatron_to_hf /
hf_to_megatron). A rank's shard:
- pipeline stage p of P holds layers [p L/P, (p+1) L/P) as its decoder.layers.0.., the embedding on the
  first stage, the final norm and output layer on the last;
- tensor-parallel rank r of R holds row block r of the column-parallel weights (the vocabulary of the
  embedding and output layer, the query groups of linear_qkv, whose rows are already grouped), column
  block r of the row-parallel ones (linear_proj, linear_fc2), and of linear_fc1 row block r of the gate
  stacked over row block r of the up projection (megatron's GLU chunks each shard's output in two);
  norms are whole on every rank;
- expert-parallel rank e of EP holds experts [e E/EP, (e+1) E/EP) of each MoE layer as its local_experts.0...
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from gyre.config.schema import ModelConfig

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")
_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight", "self_attention.linear_qkv.weight")
_COLUMNS = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
GLU = "mlp.linear_fc1.weight"
_FIRST_STAGE = ("embedding.",)
_LAST_STAGE = ("decoder.final_layernorm.", "output_layer.")


def split_dim(name: str) -> int | None:
    suffix = _LAYER.sub(r"\2", name)
    if name in _ROWS or suffix in _ROWS:
        return 0
    if suffix in _COLUMNS:
        return 1
    return None


def _tp_shard(name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    if size == 1:
        return tensor
    if name.endswith(GLU):
        gate, up = torch.chunk(tensor, 2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    dim = split_dim(name)
    return tensor if dim is None else tensor.chunk(size, dim=dim)[rank]


def _tp_merge(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    if len(shards) == 1:
        return shards[0]
    if name.endswith(GLU):
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    dim = split_dim(name)
    return shards[0] if dim is None else torch.cat(shards, dim=dim)


def stage_layers(cfg: ModelConfig, pp_rank: int, pp_size: int) -> range:
    per_stage = cfg.num_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def expert_to_global(name: str, cfg: ModelConfig, ep_rank: int, ep_size: int) -> str:
    """An expert-parallel rank's local expert j (local_experts.j) is the model's expert ep_rank * E / EP + j."""
    if ep_size == 1 or not (m := _EXPERT.match(name)):
        return name
    return f"{m.group(1)}{ep_rank * (cfg.num_experts // ep_size) + int(m.group(2))}{m.group(3)}"


def expert_to_local(name: str, cfg: ModelConfig, ep_rank: int, ep_size: int) -> str | None:
    """The inverse of expert_to_global: the local name, or None for another rank's expert."""
    if ep_size == 1 or not (m := _EXPERT.match(name)):
        return name
    per_rank = cfg.num_experts // ep_size
    owner, local = divmod(int(m.group(2)), per_rank)
    return f"{m.group(1)}{local}{m.group(3)}" if owner == ep_rank else None


def shard_state(
    full: dict[str, torch.Tensor],
    cfg: ModelConfig,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> dict[str, torch.Tensor]:
    """The part of a whole-model megatron state_dict that (tp_rank, pp_rank, ep_rank) holds, in its local names."""
    layers = stage_layers(cfg, pp_rank, pp_size)
    out = {}
    for name, tensor in full.items():
        if (local_expert := expert_to_local(name, cfg, ep_rank, ep_size)) is None:
            continue
        if m := _LAYER.match(local_expert):
            layer = int(m.group(1))
            if layer not in layers:
                continue
            local = f"decoder.layers.{layer - layers.start}.{m.group(2)}"
        elif name.startswith(_FIRST_STAGE) and pp_rank != 0:
            continue
        elif name.startswith(_LAST_STAGE) and pp_rank != pp_size - 1:
            continue
        else:
            local = name
        out[local] = _tp_shard(name, tensor, tp_rank, tp_size).contiguous()
    return out


def _global_names(local: dict[str, torch.Tensor], offset: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in local.items():
        m = _LAYER.match(name)
        out[f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m else name] = tensor
    return out


def gather_state(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole model's megatron state_dict, on every rank of this replica's model-parallel group."""
    return gather_shards({k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}, cfg)


def gather_shards(local: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Whole-model tensors from this rank's shards of them (its local names, e.g. a state_dict or the
    gradients): tensor-parallel shards all-gathered, then the stages' parts exchanged over the pipeline group.
    Every rank of the model-parallel group calls it with the same names."""
    from gyre.train.megatron_gpt import parallel_state

    local = {k: v.detach() for k, v in local.items()}
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if tp_size > 1:
        group = parallel_state.get_tensor_model_parallel_group()
        merged = {}
        for name in sorted(local):  # every rank of the group walks the same names in the same order
            shards = [torch.empty_like(local[name]) for _ in range(tp_size)]
            dist.all_gather(shards, local[name].contiguous(), group=group)
            merged[name] = _tp_merge(name, shards)
        local = merged
    pp_rank, pp_size = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    stage = _global_names(local, stage_layers(cfg, pp_rank, pp_size).start)
    stage = _gather_experts(stage, cfg)
    if pp_size == 1:
        return {k: v.clone() for k, v in stage.items()}
    parts: list[dict[str, torch.Tensor] | None] = [None] * pp_size
    dist.all_gather_object(
        parts, {k: v.cpu() for k, v in stage.items()}, group=parallel_state.get_pipeline_model_parallel_group()
    )
    return {k: v for part in parts for k, v in (part or {}).items()}


def _gather_experts(stage: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """This stage's tensors with every expert-parallel rank's experts under their global names."""
    from gyre.train.megatron_gpt import parallel_state

    ep_rank, ep_size = expert_parallel_rank_size()
    if ep_size == 1:
        return stage
    mine = {expert_to_global(k, cfg, ep_rank, ep_size): v for k, v in stage.items()}
    parts: list[dict[str, torch.Tensor] | None] = [None] * ep_size
    experts = {k: v.cpu() for k, v in mine.items() if _EXPERT.match(k)}
    dist.all_gather_object(parts, experts, group=parallel_state.get_expert_model_parallel_group())
    return mine | {k: v for part in parts for k, v in (part or {}).items()}


def expert_parallel_rank_size() -> tuple[int, int]:
    from gyre.train.megatron_gpt import parallel_state

    return parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size()
