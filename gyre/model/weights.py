"""Exact conversion between megatron-core GPTModel state_dicts and the HF names of gyre/model/llama.py.

Layouts that are not a plain rename:
- `linear_qkv.weight` holds q, k and v interleaved per query group: for each of the
  `num_query_groups` groups, its `heads_per_group` query heads, then its key head, then its value head.
- `linear_fc1.weight` is the gate projection stacked over the up projection (megatron's GLU chunks
  the output in two and applies the activation to the first half).
- With the Transformer Engine spec the two per-layer norms live inside the following linear
  (`linear_qkv.layer_norm_weight`, `mlp.linear_fc1.layer_norm_weight`); the local spec keeps them as
  `input_layernorm.weight` and `pre_mlp_layernorm.weight`. Both are read; `fused_norms` picks which
  one is written.
Megatron's `_extra_state` entries carry no weights and are skipped. Returned tensors may share
storage with the input; clone them if the source keeps training.
"""

from __future__ import annotations

import torch

from gyre.config.schema import ModelConfig
from gyre.model.llama import head_dim_of
from gyre.model.moe import is_moe_layer
from gyre.model.pretrained import expected_hf_shapes  # torch-free: also checks a directory before loading

_MEGATRON_GLOBAL = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
# megatron per-layer suffix -> HF per-layer suffix, for the plain renames.
_MEGATRON_LAYER = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_LOCAL_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}
_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
}
# Qwen3's per-head query/key norms (megatron qk_layernorm), present only with cfg.qk_layernorm.
_QK_NORMS = {
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
_QKV = "self_attention.linear_qkv.weight"
_FC1 = "mlp.linear_fc1.weight"
# a MoE layer (megatron's SequentialMLP): mlp.router.weight is HF's mlp.gate.weight, expert e's linear_fc1/fc2 are
# its gate_proj over up_proj and its down_proj
_EXPERTS = "mlp.experts.local_experts."


def _megatron_globals(cfg: ModelConfig) -> dict[str, str]:
    """With tied embeddings megatron has no output_layer weight: the output layer reuses the embedding."""
    if cfg.tie_embeddings:
        return {k: v for k, v in _MEGATRON_GLOBAL.items() if k != "output_layer.weight"}
    return _MEGATRON_GLOBAL


def _layer_renames(cfg: ModelConfig, layer: int) -> dict[str, str]:
    renames = _MEGATRON_LAYER | _QK_NORMS if cfg.qk_layernorm else dict(_MEGATRON_LAYER)
    if is_moe_layer(cfg, layer):
        del renames["mlp.linear_fc2.weight"]
        renames["mlp.router.weight"] = "mlp.gate.weight"
        for e in range(cfg.num_experts):
            renames[f"{_EXPERTS}{e}.linear_fc2.weight"] = f"mlp.experts.{e}.down_proj.weight"
    return renames


def _fc1_names(cfg: ModelConfig, layer: int) -> dict[str, str]:
    """megatron's gate-over-up linear_fc1 weights of a layer -> the HF prefix of their gate_proj/up_proj."""
    if not is_moe_layer(cfg, layer):
        return {_FC1: "mlp."}
    return {f"{_EXPERTS}{e}.linear_fc1.weight": f"mlp.experts.{e}." for e in range(cfg.num_experts)}


def _head_dims(cfg: ModelConfig) -> tuple[int, int, int]:
    head_dim = head_dim_of(cfg)
    return cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups, head_dim


def _check_keys(kind: str, got: set[str], expected: set[str], hint: str) -> None:
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        raise KeyError(
            f"{kind} state_dict does not match the ModelConfig: missing {missing}, unexpected {unexpected}. {hint}"
        )


def _check_shapes(state: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], kind: str) -> None:
    for name, shape in shapes.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(
                f"{kind} tensor {name} has shape {tuple(state[name].shape)}, the ModelConfig implies {shape}"
            )


def split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's per-group interleaved [groups*(per_group+2)*head_dim, h] -> HF q, k, v weights."""
    groups, per_group, head_dim = _head_dims(cfg)
    grouped = qkv.reshape(groups, per_group + 2, head_dim, qkv.shape[-1])
    q = grouped[:, :per_group].reshape(groups * per_group * head_dim, -1)
    k = grouped[:, per_group].reshape(groups * head_dim, -1)
    v = grouped[:, per_group + 1].reshape(groups * head_dim, -1)
    return q, k, v


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """HF q, k, v weights -> megatron's per-group interleaved linear_qkv weight."""
    groups, per_group, head_dim = _head_dims(cfg)
    h = q.shape[-1]
    grouped = torch.cat(
        [
            q.reshape(groups, per_group, head_dim, h),
            k.reshape(groups, 1, head_dim, h),
            v.reshape(groups, 1, head_dim, h),
        ],
        dim=1,
    )
    return grouped.reshape(groups * (per_group + 2) * head_dim, h)


def megatron_to_hf(state: dict[str, torch.Tensor | None], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """GPTModel.state_dict() (local or Transformer Engine spec) -> LlamaForCausalLM state_dict."""
    weights = {k: v for k, v in state.items() if not k.endswith("._extra_state")}
    fused = any(k.endswith(".linear_qkv.layer_norm_weight") for k in weights)
    norms = _FUSED_NORMS if fused else _LOCAL_NORMS
    globals_ = _megatron_globals(cfg)
    expected = set(globals_)
    for i in range(cfg.num_layers):
        expected |= {f"decoder.layers.{i}.{s}" for s in [*_layer_renames(cfg, i), *norms, _QKV, *_fc1_names(cfg, i)]}
    _check_keys(
        "megatron",
        set(weights),
        expected,
        "Build the GPTModel from the same ModelConfig (see gyre/train/megatron_gpt.py).",
    )

    out = {hf: weights[mc] for mc, hf in globals_.items()}
    if cfg.tie_embeddings:  # HF checkpoints of tied models still carry lm_head; a copy keeps safetensors happy
        out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    for i in range(cfg.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for mc, hf in (_layer_renames(cfg, i) | norms).items():
            out[dst + hf] = weights[src + mc]
        q, k, v = split_qkv(weights[src + _QKV], cfg)
        out[dst + "self_attn.q_proj.weight"] = q
        out[dst + "self_attn.k_proj.weight"] = k
        out[dst + "self_attn.v_proj.weight"] = v
        for mc, hf in _fc1_names(cfg, i).items():
            gate, up = torch.chunk(weights[src + mc], 2, dim=0)
            out[dst + hf + "gate_proj.weight"] = gate
            out[dst + hf + "up_proj.weight"] = up
    out = {k: v.detach().contiguous() for k, v in out.items()}
    _check_shapes(out, expected_hf_shapes(cfg), "converted HF")
    return out


def hf_to_megatron(
    state: dict[str, torch.Tensor], cfg: ModelConfig, fused_norms: bool = False
) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM state_dict -> GPTModel state_dict (load it with strict=False: no _extra_state).

    fused_norms=True writes the Transformer Engine spec's norm names instead of the local spec's.
    """
    shapes = expected_hf_shapes(cfg)
    _check_keys(
        "HF", set(state), set(shapes), "Convert a checkpoint of gyre/model/llama.py built from the same ModelConfig."
    )
    _check_shapes(state, shapes, "HF")
    norms = _FUSED_NORMS if fused_norms else _LOCAL_NORMS
    out = {mc: state[hf] for mc, hf in _megatron_globals(cfg).items()}
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for mc, hf in (_layer_renames(cfg, i) | norms).items():
            out[dst + mc] = state[src + hf]
        out[dst + _QKV] = merge_qkv(
            state[src + "self_attn.q_proj.weight"],
            state[src + "self_attn.k_proj.weight"],
            state[src + "self_attn.v_proj.weight"],
            cfg,
        )
        for mc, hf in _fc1_names(cfg, i).items():
            out[dst + mc] = torch.cat([state[src + hf + "gate_proj.weight"], state[src + hf + "up_proj.weight"]], dim=0)
    return {k: v.detach().contiguous() for k, v in out.items()}
