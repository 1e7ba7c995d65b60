"""The serving-side model: a Llama/Qwen-style decoder (dense, or Qwen3-MoE) in plain torch with HF parameter names.

Same numerics as the megatron-core GPTModel the trainer uses (see gyre/model/weights.py for the
name and layout conversion). The caller owns the KV cache: `forward` takes the past keys/values
of each layer and returns the new ones for the tokens it was given.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from gyre.config.schema import ModelConfig
from gyre.model.moe import expert_ffn_size, is_moe_layer

LayerKV = tuple[torch.Tensor, torch.Tensor]  # each [B, kv_heads, S, head_dim]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).type_as(x) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, 1, T, head_dim] (non-interleaved halves, as Megatron and HF)."""
    arange = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = 1.0 / (theta ** (arange / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)  # cos/sin are fp32; bf16 activations stay bf16


def head_dim_of(cfg: ModelConfig) -> int:
    """The per-head width: cfg.head_dim when set (Qwen3 style), else hidden_size // num_attention_heads."""
    return cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_query_groups
        self.head_dim = head_dim_of(cfg)
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        # Qwen3: per-head RMSNorm of queries and keys before RoPE (megatron's qk_layernorm).
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_layernorm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_layernorm else None

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> rotated q [B, heads, T, hd], rotated k and v [B, kv_heads, T, hd]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: LayerKV | None,
        mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, LayerKV]:
        b, t, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        new_kv = (k, v)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        rep = self.n_heads // self.n_kv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        if mask is None:
            s = k.shape[2]
            mask = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(s - t)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), new_kv


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Qwen3-MoE's sparse block (transformers' Qwen3MoeSparseMoeBlock): softmax over the router logits, the top-k
    experts' probabilities (renormalised to sum to one when norm_topk_prob) weighting their SwiGLU outputs.

    `routed` keeps the last forward's expert ids [..., top_k], which the engine returns for routing replay.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        width = dataclasses.replace(cfg, ffn_hidden_size=expert_ffn_size(cfg))
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(width) for _ in range(cfg.num_experts))
        self.routed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.gate(flat), dim=-1, dtype=torch.float32)
        experts = self.select(probs)
        weights = probs.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(flat)
        for e in experts.unique().tolist():
            rows, slot = torch.nonzero(experts == e, as_tuple=True)
            out.index_add_(0, rows, self.experts[e](flat[rows]) * weights[rows, slot, None])
        self.routed = experts.view(*x.shape[:-1], self.top_k)
        return out.view_as(x)

    def select(self, probs: torch.Tensor) -> torch.Tensor:
        """The experts [tokens, top_k] each token is routed to: the most probable, in descending order."""
        return torch.topk(probs, self.top_k, dim=-1).indices


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = SparseMoE(cfg) if is_moe_layer(cfg, index) else MLP(cfg)

    def forward(self, x, cos, sin, past, mask):  # noqa: ANN001, ANN201 - internal
        h, kv = self.self_attn(self.input_layernorm(x), cos, sin, past, mask)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


class LlamaForCausalLM(nn.Module):
    """HF-named decoder: `model.embed_tokens`, `model.layers.N.*`, `model.norm`, `lm_head`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        past: list[LayerKV] | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[LayerKV]]:
        """input_ids, positions [B, T]; mask [B or 1, 1, T, S_past + T] bool, True = attend.

        Returns logits [B, T, V] in fp32 and this call's keys/values per layer.
        """
        cos, sin = rope_cos_sin(positions, head_dim_of(self.cfg), self.cfg.rope_theta)
        x = self.model.embed_tokens(input_ids)
        new_kv: list[LayerKV] = []
        for i, layer in enumerate(self.model.layers):
            x, kv = layer(x, cos, sin, None if past is None else past[i], mask)
            new_kv.append(kv)
        return self.lm_head(self.model.norm(x)).float(), new_kv
