"""HF-format checkpoint directories: config.json (Qwen2, Qwen3 or Qwen3-MoE style) + model.safetensors (+ tokenizer).

This is what engines load on start and on `/update_weights_from_disk`, and what a production
SGLang server would read from the same path.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gyre.config.schema import ModelConfig
from gyre.model.llama import LlamaForCausalLM, head_dim_of
from gyre.model.moe import expert_ffn_size
from gyre.model.pretrained import TOKENIZER_FILES, model_config_from_hf

__all__ = ["hf_config", "load_hf_state", "load_llama", "model_config_from_hf", "save_hf_checkpoint"]

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # sharded checkpoints (transformers' save_pretrained)


def hf_config(cfg: ModelConfig, torch_dtype: str = "float32", eos_token_id: int | None = None) -> dict:
    """Qwen2 style, or Qwen3 style (per-head q/k norms, explicit head_dim) when cfg.qk_layernorm."""
    qwen3 = cfg.qk_layernorm
    out = {
        "architectures": ["Qwen3ForCausalLM" if qwen3 else "Qwen2ForCausalLM"],
        "model_type": "qwen3" if qwen3 else "qwen2",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": head_dim_of(cfg),
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": torch_dtype,
    }
    if qwen3:  # fields transformers' and SGLang's Qwen3 configs read
        out |= {"attention_dropout": 0.0, "rope_scaling": None, "use_sliding_window": False, "sliding_window": None}
        out |= {"max_window_layers": cfg.num_layers, "initializer_range": cfg.init_std, "use_cache": True}
    if cfg.num_experts:
        out |= _qwen3_moe_fields(cfg)
    if eos_token_id is not None:
        out["eos_token_id"] = eos_token_id
    return out


def _qwen3_moe_fields(cfg: ModelConfig) -> dict:
    """transformers' Qwen3MoeConfig keys (Qwen3-MoE has Qwen3's attention: q/k norms, decoupled head_dim)."""
    if not cfg.qk_layernorm:
        raise ValueError("a mixture-of-experts model is written as Qwen3-MoE, which has q/k norms: set qk_layernorm")
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": expert_ffn_size(cfg),
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": list(cfg.mlp_only_layers),
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": cfg.router_aux_loss_coef > 0,
    }


def save_hf_checkpoint(
    directory: str | Path,
    state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write atomically: a temp directory renamed into place, so a reader never sees half a checkpoint."""
    final = Path(directory)
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(tmp / WEIGHTS_FILE))
    dtypes = {str(v.dtype).removeprefix("torch.") for v in state.values()}
    eos = _tokenizer_eos_id(tokenizer_dir)
    dtype = dtypes.pop() if len(dtypes) == 1 else "float32"
    source = Path(cfg.path) / "config.json" if cfg.path else None
    if source is not None and source.is_file():  # a model from disk keeps its own config (architecture, ids)
        config = json.loads(source.read_text()) | {"torch_dtype": dtype}
        config |= {"dtype": dtype} if "dtype" in config else {}  # transformers 5's name
    else:
        config = hf_config(cfg, dtype, eos)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy2(Path(tokenizer_dir) / name, tmp / name)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def _tokenizer_eos_id(tokenizer_dir: str | Path | None) -> int | None:
    if tokenizer_dir is None:
        return None
    from gyre.model.tokenizer import Tokenizer

    return Tokenizer.load(tokenizer_dir).eos_id


def load_hf_state(directory: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """config.json and the weights of an HF directory: one model.safetensors or the shards its index names
    (transformers' save_pretrained). A tied model saved without lm_head gets it as a copy of the embedding."""
    d = Path(directory)
    index = d / INDEX_FILE
    if not (d / "config.json").exists() or not ((d / WEIGHTS_FILE).exists() or index.exists()):
        raise FileNotFoundError(f"{d} is not a checkpoint: expected config.json and {WEIGHTS_FILE} or {INDEX_FILE}")
    cfg = model_config_from_hf(json.loads((d / "config.json").read_text()))
    if (d / WEIGHTS_FILE).exists():
        state = load_file(str(d / WEIGHTS_FILE))
    else:
        state = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            state |= load_file(str(d / shard))
    if cfg.tie_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    return cfg, state


def load_llama(directory: str | Path) -> LlamaForCausalLM:
    cfg, state = load_hf_state(directory)
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(state, strict=True)
    return model.eval()
