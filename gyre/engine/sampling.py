"""Sampling parameters (SGLang's names and defaults) and batched token sampling.

Logprobs are always `log_softmax` of the raw fp32 logits, before temperature, top-k and top-p: the
same quantity the trainer computes for a token, so behaviour and training logprobs are comparable.
Each request draws its uniforms from its own generator, so a seeded request samples the same tokens
whichever requests it is batched with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

GREEDY_EPS = 1e-6  # SGLang treats temperature below this as greedy
_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_new_tokens": 0,
    "stop": None,
    "stop_token_ids": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "sampling_seed": None,
}
# SGLang fields this engine accepts only at their neutral value.
_NEUTRAL: dict[str, Any] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
    "custom_params": None,
    "beam_width": None,
    "watermark": None,
    "stream_interval": None,
}


@dataclass(frozen=True)
class SamplingSpec:
    """One request's validated sampling parameters."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"sampling_params.{name} must be an integer, got {value!r}")
    return value


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"sampling_params.{name} must be a finite number, got {value!r}")
    return float(value)


def _as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"sampling_params.{name} must be true or false, got {value!r}")
    return value


def parse_sampling_params(raw: Any, vocab_size: int) -> SamplingSpec:
    """SGLang `sampling_params` dict -> SamplingSpec; raises ValueError with the offending field."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"sampling_params must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_DEFAULTS) - set(_NEUTRAL))
    if unknown:
        raise ValueError(f"unknown sampling_params {unknown}; supported: {sorted(_DEFAULTS)}")
    for name, neutral in _NEUTRAL.items():
        if raw.get(name, neutral) not in (neutral, None):
            raise ValueError(f"sampling_params.{name}={raw[name]!r} is not supported by the embedded engine")
    p = {k: (_DEFAULTS[k] if raw.get(k) is None else raw[k]) for k in _DEFAULTS}

    max_new = _as_int("max_new_tokens", p["max_new_tokens"])
    min_new = _as_int("min_new_tokens", p["min_new_tokens"])
    temperature = _as_float("temperature", p["temperature"])
    top_p = _as_float("top_p", p["top_p"])
    top_k = _as_int("top_k", p["top_k"])
    if max_new < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {max_new}")
    if not 0 <= min_new <= max_new:
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens={max_new}], got {min_new}")
    if temperature < 0:
        raise ValueError(f"temperature must be non-negative, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k != -1 and top_k < 1:
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}")

    stop = p["stop"]
    stop_strs = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stop_strs):
        raise ValueError(f"sampling_params.stop must be a string or a list of non-empty strings, got {stop!r}")
    ids = p["stop_token_ids"] or []
    if not isinstance(ids, list):
        raise ValueError(f"sampling_params.stop_token_ids must be a list of token ids, got {ids!r}")
    for t in ids:
        if _as_int("stop_token_ids[]", t) < 0 or t >= vocab_size:
            raise ValueError(f"stop token id {t} is outside the vocabulary [0, {vocab_size})")
    seed = p["sampling_seed"]
    if seed is not None:
        seed = _as_int("sampling_seed", seed)
    return SamplingSpec(
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        top_k=-1 if top_k >= vocab_size else top_k,
        min_new_tokens=min_new,
        stop=stop_strs,
        stop_token_ids=frozenset(int(t) for t in ids),
        ignore_eos=_as_bool("ignore_eos", p["ignore_eos"]),
        skip_special_tokens=_as_bool("skip_special_tokens", p["skip_special_tokens"]),
        no_stop_trim=_as_bool("no_stop_trim", p["no_stop_trim"]),
        sampling_seed=seed,
    )


@dataclass
class BatchSamplingParams:
    """Per-row tensors for a batch of requests; rebuilt only when the running set changes."""

    temperature: torch.Tensor  # [B] float, 1.0 for greedy rows (unused there)
    top_p: torch.Tensor  # [B] float
    top_k: torch.Tensor  # [B] long, vocab size when disabled
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    needs_filter: bool  # some row uses top-k or top-p

    @classmethod
    def build(
        cls, specs: list[SamplingSpec], vocab_size: int, device: torch.device | str = "cpu"
    ) -> BatchSamplingParams:
        greedy = [s.greedy for s in specs]
        temperature = [1.0 if g else s.temperature for s, g in zip(specs, greedy, strict=True)]
        return cls(
            temperature=torch.tensor(temperature, device=device),
            top_p=torch.tensor([s.top_p for s in specs], device=device),
            top_k=torch.tensor([vocab_size if s.top_k < 0 else s.top_k for s in specs], device=device),
            greedy=torch.tensor(greedy, device=device),
            all_greedy=all(greedy),
            needs_filter=any(s.top_p < 1.0 or 0 < s.top_k < vocab_size for s in specs),
        )


def sample_tokens(
    logits: torch.Tensor,
    params: BatchSamplingParams,
    uniforms: torch.Tensor | None,
    banned: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] fp32 -> (token ids [B], logprobs [B] of the raw logits).

    uniforms [B] in [0, 1) drive inverse-CDF sampling (None when every row is greedy);
    banned [B, V] bool removes tokens from sampling only (min_new_tokens hides stop tokens).
    """
    logprobs_all = torch.log_softmax(logits, dim=-1)
    masked = logits if banned is None else logits.masked_fill(banned, float("-inf"))
    greedy_ids = masked.argmax(dim=-1)
    if params.all_greedy:
        tokens = greedy_ids
    else:
        if uniforms is None:
            raise ValueError("uniforms are required when some row samples")
        probs = torch.softmax(masked / params.temperature[:, None], dim=-1)
        if params.needs_filter:
            probs, order = probs.sort(dim=-1, descending=True)
            rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
            before = probs.cumsum(dim=-1) - probs  # mass strictly before each sorted token
            keep = (rank < params.top_k[:, None]) & ((before < params.top_p[:, None]) | (rank == 0))
            probs = probs * keep
        cdf = probs.cumsum(dim=-1)
        target = (uniforms * cdf[:, -1])[:, None]
        idx = torch.searchsorted(cdf, target, right=True).clamp_max(probs.shape[-1] - 1)
        sampled = order.gather(1, idx)[:, 0] if params.needs_filter else idx[:, 0]
        tokens = torch.where(params.greedy, greedy_ids, sampled)
    return tokens, logprobs_all.gather(1, tokens[:, None])[:, 0]
