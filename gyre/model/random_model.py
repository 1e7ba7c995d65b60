"""Random-weights HF-format models of any size, for systems tests on machines that cannot download weights.

    python -m gyre.model.random_model OUT_DIR --shape qwen3-0.6b --dtype bfloat16

writes config.json (Qwen3 or, for the qwen3-moe-* shapes, Qwen3-MoE style), model.safetensors and a tokenizer with gyre's chat template: a
directory the embedded engine, the Megatron trainer and an SGLang server all load.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import torch

from gyre.config.schema import ModelConfig
from gyre.model.hf_io import save_hf_checkpoint
from gyre.model.llama import LlamaForCausalLM
from gyre.model.tokenizer import Tokenizer

# Qwen3 and Qwen3-MoE shapes (transformers' configs). Real checkpoints' other fields match hf_config's Qwen3 output.
SHAPES: dict[str, ModelConfig] = {
    "qwen3-0.6b": ModelConfig(
        vocab_size=151936,
        hidden_size=1024,
        num_layers=28,
        num_attention_heads=16,
        num_query_groups=8,
        head_dim=128,
        ffn_hidden_size=3072,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        tie_embeddings=True,
        qk_layernorm=True,
    ),
    "qwen3-1.7b": ModelConfig(
        vocab_size=151936,
        hidden_size=2048,
        num_layers=28,
        num_attention_heads=16,
        num_query_groups=8,
        head_dim=128,
        ffn_hidden_size=6144,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        tie_embeddings=True,
        qk_layernorm=True,
    ),
    # CI-sized: every Qwen3 feature (q/k norms, decoupled head_dim, GQA, tied embeddings), tiny.
    "qwen3-tiny": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=32,
        ffn_hidden_size=128,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        tie_embeddings=True,
        qk_layernorm=True,
    ),
    # Qwen3-30B-A3B's shape (its config.json): 128 experts of width 768, top-8, renormalised, every layer MoE.
    "qwen3-moe-30b-a3b": ModelConfig(
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_attention_heads=32,
        num_query_groups=4,
        head_dim=128,
        ffn_hidden_size=6144,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        tie_embeddings=False,
        qk_layernorm=True,
        num_experts=128,
        num_experts_per_tok=8,
        moe_ffn_hidden_size=768,
        norm_topk_prob=True,
    ),
    # CI-sized Qwen3-MoE: 4 experts, top-2, both layers MoE.
    "qwen3-moe-tiny": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=32,
        ffn_hidden_size=128,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        tie_embeddings=False,
        qk_layernorm=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_ffn_hidden_size=64,
        norm_topk_prob=True,
    ),
}


def parameter_count(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return sum(p.numel() for p in model.parameters())  # tied weights count once


def random_hf_state(
    cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """HF-named weights for cfg: norms at one, every other matrix N(0, cfg.init_std), drawn from `seed`.

    Built tensor by tensor (no module init), so a 1B model takes seconds and no second copy.
    """
    with torch.device("meta"):
        names = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in names.items():
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            t = torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, cfg.init_std, generator=gen)
            state[name] = t.to(dtype)
    if cfg.tie_embeddings:  # HF checkpoints of tied models still carry lm_head
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    return state


def default_tokenizer(vocab_size: int) -> Tokenizer:
    """A small BPE over a fixed text with gyre's chat special tokens (the model's vocab may be larger)."""
    corpus = [
        "def solve(values):\n    return sorted(set(values))\n",
        "Write the value 42 to answer.txt and check it with cat answer.txt.",
        "The quick brown fox jumps over the lazy dog. " * 3,
    ] * 20
    return Tokenizer.train(corpus, min(vocab_size, 1024))


def create_random_model(
    directory: str | Path,
    cfg: ModelConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Write a random-weights checkpoint directory (config.json, model.safetensors, tokenizer files)."""
    tokenizer = tokenizer or default_tokenizer(cfg.vocab_size)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's {cfg.vocab_size}")
    state = random_hf_state(cfg, seed, dtype, device)
    with tempfile.TemporaryDirectory(prefix="gyre-tokenizer-") as tok_dir:
        tokenizer.save(tok_dir)
        return save_hf_checkpoint(directory, state, cfg, tok_dir)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gyre.model.random_model", description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-layers", type=int, default=None, help="override the shape's layer count")
    args = p.parse_args(argv)
    cfg = SHAPES[args.shape]
    if args.num_layers:
        cfg = dataclasses.replace(cfg, num_layers=args.num_layers)
    path = create_random_model(args.out_dir, cfg, args.seed, getattr(torch, args.dtype))
    print(f"{path}: {parameter_count(cfg) / 1e6:.0f}M parameters ({args.shape}, {args.dtype})")


if __name__ == "__main__":
    main()
