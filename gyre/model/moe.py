"""Which decoder layers of a Qwen3-MoE model are mixture-of-experts, and their widths (torch-free).

transformers' Qwen3MoeDecoderLayer: layer i has a sparse MoE block when the model has experts, i is not in
mlp_only_layers, and (i + 1) % decoder_sparse_step == 0; the others keep a dense SwiGLU of intermediate_size.
"""

from __future__ import annotations

from gyre.config.schema import ModelConfig


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    return cfg.num_experts > 0 and layer not in cfg.mlp_only_layers and (layer + 1) % cfg.decoder_sparse_step == 0


def moe_layer_indices(cfg: ModelConfig) -> list[int]:
    """The MoE layers in order: the order routed-expert records are stored and replayed in."""
    return [i for i in range(cfg.num_layers) if is_moe_layer(cfg, i)]


def expert_ffn_size(cfg: ModelConfig) -> int:
    return cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
