"""megatron-core layer-spec wiring for tree attention: the GPTModel stays megatron's.

A tree micro-batch reaches the layers as GPTModel's `attention_mask` argument holding a
TreeAttentionPlan instead of a tensor. Two subclasses act only on that case and defer to megatron
for every tensor mask, so dense/causal forwards keep megatron's numerics:
- TreeSelfAttention picks each token's RoPE row by its depth (megatron's "rope" path rotates by
  sequence index and ignores position_ids); the rotation itself stays megatron's.
- TreeDotProductAttention runs gyre.train.tree_attention on the rotated q, k, v. For a segment of a
  split tree (plan.prefix set) it puts the cached ancestors' keys/values of its layer in front of the
  segment's own, and hands the segment's own to the plan's prefix (gyre/train/split_tree.py).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from gyre.train.tree_attention import TreeAttentionPlan, tree_attention

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*")
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec


def _rows_at(emb: Any, positions: torch.Tensor) -> Any:
    """RoPE table [S, 1, 1, D] (or a (q, k) pair of them) -> the rows of the given positions."""
    if emb is None:
        return None
    if isinstance(emb, tuple):
        return tuple(_rows_at(e, positions) for e in emb)
    return emb.index_select(0, positions.to(emb.device))


class TreeSelfAttention(SelfAttention):
    def forward(self, hidden_states: torch.Tensor, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: D102
        if isinstance(attention_mask, TreeAttentionPlan):
            if hidden_states.shape[1] != 1:
                raise ValueError(f"a tree micro-batch is one packed row, got batch size {hidden_states.shape[1]}")
            if args:
                raise TypeError("pass SelfAttention's optional arguments by keyword with a tree plan")
            table = attention_mask.rope_table  # megatron's table covers the input length only, a segment goes deeper
            if table is None:
                table, rows = kwargs.get("rotary_pos_emb"), attention_mask.positions
            else:  # the plan's own table starts at position rope_offset
                rows = attention_mask.positions - attention_mask.rope_offset
            kwargs["rotary_pos_emb"] = _rows_at(table, rows)
        return super().forward(hidden_states, attention_mask, *args, **kwargs)


class TreeDotProductAttention(DotProductAttention):
    def forward(  # noqa: D102
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not isinstance(attention_mask, TreeAttentionPlan):
            return super().forward(query, key, value, attention_mask, *args, **kwargs)
        if self.config.attention_dropout > 0 and self.training:
            raise ValueError("tree attention does not implement attention dropout; set attention_dropout=0")
        # [S, 1, heads, D] -> [heads, S, D]
        q, k, v = (t[:, 0].transpose(0, 1) for t in (query, key, value))
        prefix = None
        if attention_mask.prefix is not None:
            prefix = attention_mask.prefix.layer(self.layer_number, k, v)
        out = tree_attention(q, k, v, attention_mask, self.softmax_scale, prefix)
        return out.transpose(0, 1).reshape(out.shape[1], 1, -1)  # [S, 1, heads * D]


def tree_layer_spec(spec: ModuleSpec) -> ModuleSpec:
    """A copy of megatron's local GPT layer spec with the tree-aware self-attention modules."""
    attn = spec.submodules.self_attention
    if attn.module is not SelfAttention or attn.submodules.core_attention is not DotProductAttention:
        raise ValueError(
            f"tree attention wraps megatron's local SelfAttention/DotProductAttention, this spec has "
            f"{attn.module.__name__}/{getattr(attn.submodules.core_attention, '__name__', attn.submodules.core_attention)}"
        )
    new_attn = dataclasses.replace(
        attn,
        module=TreeSelfAttention,
        submodules=dataclasses.replace(attn.submodules, core_attention=TreeDotProductAttention),
    )
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=new_attn))


def accepts_tree_plans(model: torch.nn.Module) -> bool:
    """Whether every self-attention layer of `model` is tree-aware (built from tree_layer_spec)."""
    attns = [m for m in model.modules() if isinstance(m, SelfAttention)]
    return bool(attns) and all(
        isinstance(m, TreeSelfAttention) and isinstance(m.core_attention, TreeDotProductAttention) for m in attns
    )
