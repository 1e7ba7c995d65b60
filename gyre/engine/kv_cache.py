"""A slot-based KV cache and the cached forward pass that writes into it in place.

Running request i owns slot i (slots stay compact: a finished request's slot is refilled from the
last one), so a decode step attends over a view `k[:, :B, :, :L]` of one preallocated tensor
instead of concatenating every request's cache each step. The forward reuses the modules and RoPE
of `gyre.model.llama.LlamaForCausalLM`, and GQA goes through SDPA's grouped form rather than
`repeat_interleave`, so no step copies the whole cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gyre.model.llama import LlamaForCausalLM, head_dim_of, rope_cos_sin

Write = tuple[torch.Tensor, torch.Tensor] | tuple[int, slice]


class SlotKVCache:
    """Keys/values [layers, slots, kv_heads, capacity, head_dim], grown by doubling up to the limits."""

    def __init__(self, model: LlamaForCausalLM, max_slots: int, max_len: int) -> None:
        cfg = model.cfg
        self.num_layers = cfg.num_layers
        self.kv_heads = cfg.num_query_groups
        self.head_dim = head_dim_of(cfg)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_slots = max_slots
        self.max_len = max_len
        self.k = torch.empty(0)
        self.v = torch.empty(0)

    @property
    def slots(self) -> int:
        return self.k.shape[1] if self.k.dim() == 5 else 0

    @property
    def capacity(self) -> int:
        return self.k.shape[3] if self.k.dim() == 5 else 0

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def ensure(self, slots: int, length: int) -> None:
        """Make room for `slots` slots of `length` tokens, keeping existing contents."""
        if slots > self.max_slots or length > self.max_len:
            raise ValueError(
                f"KV cache request {slots} slots x {length} tokens exceeds {self.max_slots} x {self.max_len}"
            )
        if slots <= self.slots and length <= self.capacity:
            return
        new_slots = min(self.max_slots, max(slots, 2 * self.slots, 4))
        new_len = min(self.max_len, max(length, 2 * self.capacity, 256))
        shape = (self.num_layers, new_slots, self.kv_heads, new_len, self.head_dim)
        # Zeros, not empty: masked positions still enter `weights @ values`, and 0 * NaN is NaN.
        k = torch.zeros(shape, device=self.device, dtype=self.dtype)
        v = torch.zeros(shape, device=self.device, dtype=self.dtype)
        if self.slots:
            k[:, : self.slots, :, : self.capacity] = self.k
            v[:, : self.slots, :, : self.capacity] = self.v
        self.k, self.v = k, v

    def free(self) -> None:
        self.k = torch.empty(0)
        self.v = torch.empty(0)

    def load(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy a prefix's keys/values [layers, kv_heads, n, head_dim] into the start of a slot."""
        n = k.shape[2]
        self.k[:, slot, :, :n] = k
        self.v[:, slot, :, :n] = v

    def read(self, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the first n positions of a slot, [layers, kv_heads, n, head_dim] each."""
        return self.k[:, slot, :, :n].clone(), self.v[:, slot, :, :n].clone()

    def move(self, src: int, dst: int, n: int) -> None:
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]


def _attention_step(
    attn: torch.nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write: Write,
    read_len: int,
    mask: torch.Tensor,
) -> torch.Tensor:
    """One attention block: project, rotate, write the new keys/values into the cache, attend.

    `write` is (rows [B], positions [B]) for a decode step, or (slot, slice of positions) for a prefill.
    """
    b, t, _ = x.shape
    nh, nkv, hd = attn.n_heads, attn.n_kv, attn.head_dim
    q, k, v = attn.project(x, cos, sin)
    rows, cols = write
    if isinstance(cols, torch.Tensor):  # decode: one new position per row, at that row's own length
        k_cache[rows, :, cols] = k[:, :, 0]
        v_cache[rows, :, cols] = v[:, :, 0]
        keys, values = k_cache[:b, :, :read_len], v_cache[:b, :, :read_len]
        # Heads of one KV group attend together: [B, kv, rep, hd] against [B, kv, L, hd].
        out = F.scaled_dot_product_attention(
            q.reshape(b, nkv, nh // nkv, hd), keys, values, attn_mask=mask, scale=1.0 / math.sqrt(hd)
        )
        out = out.reshape(b, nh, 1, hd)
    else:  # prefill of one slot: a contiguous run of positions
        k_cache[rows, :, cols] = k[0]
        v_cache[rows, :, cols] = v[0]
        keys, values = k_cache[rows : rows + 1, :, :read_len], v_cache[rows : rows + 1, :, :read_len]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=1.0 / math.sqrt(hd), enable_gqa=nh != nkv
        )
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def _run_layers(
    model: LlamaForCausalLM,
    cache: SlotKVCache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    write: Write,
    read_len: int,
    mask: torch.Tensor,
) -> torch.Tensor:
    cfg = model.cfg
    cos, sin = rope_cos_sin(positions, head_dim_of(cfg), cfg.rope_theta)
    x = model.model.embed_tokens(input_ids)
    for i, layer in enumerate(model.model.layers):
        h = _attention_step(
            layer.self_attn, layer.input_layernorm(x), cos, sin, cache.k[i], cache.v[i], write, read_len, mask
        )
        x = x + h
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.model.norm(x)


def prefill_slot(
    model: LlamaForCausalLM, cache: SlotKVCache, slot: int, tokens: torch.Tensor, start: int
) -> torch.Tensor:
    """Run tokens [T] at positions start.. through the model with the slot's first `start` positions
    as context, store their keys/values, and return fp32 logits [V] of the last position."""
    t = tokens.shape[0]
    end = start + t
    device = cache.device
    tokens = tokens.to(device)
    positions = torch.arange(start, end, device=device)[None, :]
    mask = torch.ones(t, end, dtype=torch.bool, device=device).tril(start)[None, None]
    hidden = _run_layers(model, cache, tokens[None, :], positions, (slot, slice(start, end)), end, mask)
    return model.lm_head(hidden[0, -1]).float()


def decode_slots(
    model: LlamaForCausalLM, cache: SlotKVCache, last_tokens: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """One decode step for slots 0..B-1: row i feeds last_tokens[i] at position lengths[i] (its current
    KV length). Returns fp32 logits [B, V]."""
    b = last_tokens.shape[0]
    read_len = int(lengths.max()) + 1
    device = cache.device
    last_tokens, lengths = last_tokens.to(device), lengths.to(device)
    mask = (torch.arange(read_len, device=device)[None, :] <= lengths[:, None])[:, None, None, :]
    rows = torch.arange(b, device=device)
    hidden = _run_layers(model, cache, last_tokens[:, None], lengths[:, None], (rows, lengths), read_len, mask)
    return model.lm_head(hidden[:, 0]).float()
