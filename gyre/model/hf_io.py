"""HF-format checkpoint directories: config.json (Qwen2/Llama style) + model.safetensors (+ tokenizer).

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
from gyre.model.llama import LlamaForCausalLM

WEIGHTS_FILE = "model.safetensors"


def hf_config(cfg: ModelConfig) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.hidden_size // cfg.num_attention_heads,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
    }


def model_config_from_hf(config: dict) -> ModelConfig:
    return ModelConfig(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_query_groups=config.get("num_key_value_heads", config["num_attention_heads"]),
        ffn_hidden_size=config["intermediate_size"],
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        rope_theta=float(config.get("rope_theta", 10000.0)),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


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
    (tmp / "config.json").write_text(json.dumps(hf_config(cfg), indent=2))
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy2(Path(tokenizer_dir) / name, tmp / name)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def load_hf_state(directory: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    d = Path(directory)
    if not (d / "config.json").exists() or not (d / WEIGHTS_FILE).exists():
        raise FileNotFoundError(f"{d} is not a checkpoint: expected config.json and {WEIGHTS_FILE}")
    cfg = model_config_from_hf(json.loads((d / "config.json").read_text()))
    return cfg, load_file(str(d / WEIGHTS_FILE))


def load_llama(directory: str | Path) -> LlamaForCausalLM:
    cfg, state = load_hf_state(directory)
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(state, strict=True)
    return model.eval()
