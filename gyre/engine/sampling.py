"""Sampling parameters (SGLang's names and defaults) and batched token sampling.

Each sampled token gets two behaviour logprobs, both of the fp32 logits divided by the request's
temperature (a greedy request counts as temperature 1 and top-k 1, as SGLang normalises it):
- tempered: `log_softmax(logits / T)`, truncation by top-k/top-p/min-p ignored. What SGLang 0.5.23
  returns as `output_token_logprobs` (sampler.py: `log(softmax(logits / T))`, taken before its
  top-k/top-p/min-p filter) and gyre's default (`rl.logprob_distribution=tempered`).
- truncated: the same probabilities renormalised over the kept set (the top-k tokens, within the
  top-p nucleus, at least min-p times the most likely token's probability): exactly the distribution
  the token was drawn from. What SGLang returns as `output_token_sampling_logprobs` when a request
  sets `return_sampling_mask` (`rl.logprob_distribution=truncated`).
The trainer computes the same two definitions (gyre/train/sampling_logprobs.py). Tokens hidden by
min_new_tokens are hidden from sampling only; the logprobs are of the unhidden logits.
Each request draws its uniforms from its own generator, so a seeded request samples the same tokens
whichever requests it is batched with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from gyre.traj.tree import GREEDY_EPS

_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
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
    min_p: float = 0.0  # keep tokens with probability >= min_p * the most likely token's
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
    min_p = _as_float("min_p", p["min_p"])
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
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")

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
        min_p=min_p,
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

    temperature: torch.Tensor  # [B] float, 1.0 for greedy rows
    top_p: torch.Tensor  # [B] float
    top_k: torch.Tensor  # [B] long, vocab size when disabled
    min_p: torch.Tensor  # [B] float
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    needs_filter: bool  # some row uses top-k, top-p or min-p

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
            min_p=torch.tensor([s.min_p for s in specs], device=device),
            greedy=torch.tensor(greedy, device=device),
            all_greedy=all(greedy),
            needs_filter=any(s.top_p < 1.0 or 0 < s.top_k < vocab_size or s.min_p > 0 for s in specs),
        )


class SampledTokens(NamedTuple):
    tokens: torch.Tensor  # [B] long
    logprobs: torch.Tensor  # [B] tempered behaviour logprob
    truncated_logprobs: torch.Tensor  # [B] renormalised over the kept set (0 on greedy rows)


def _kept_sorted(probs_sorted: torch.Tensor, params: BatchSamplingParams) -> torch.Tensor:
    """[B, V] bool over probabilities sorted in descending order: the tokens top-k, top-p and min-p keep."""
    rank = torch.arange(probs_sorted.shape[-1], device=probs_sorted.device)[None, :]
    before = probs_sorted.cumsum(dim=-1) - probs_sorted  # mass strictly before each sorted token
    keep = (rank < params.top_k[:, None]) & ((before < params.top_p[:, None]) | (rank == 0))
    return keep & (probs_sorted >= params.min_p[:, None] * probs_sorted[:, :1])


def sample_tokens(
    logits: torch.Tensor,
    params: BatchSamplingParams,
    uniforms: torch.Tensor | None,
    banned: torch.Tensor | None = None,
) -> SampledTokens:
    """logits [B, V] fp32 -> token ids [B] with their tempered and truncated logprobs (module docstring).

    uniforms [B] in [0, 1) drive inverse-CDF sampling (None when every row is greedy);
    banned [B, V] bool removes tokens from sampling only (min_new_tokens hides stop tokens).
    """
    scaled = logits / params.temperature[:, None]
    tempered_all = torch.log_softmax(scaled, dim=-1)
    masked = scaled if banned is None else scaled.masked_fill(banned, float("-inf"))
    greedy_ids = masked.argmax(dim=-1)
    kept: torch.Tensor | None = None  # [B, V] in vocabulary order, of the unbanned distribution
    if params.all_greedy:
        tokens = greedy_ids
    else:
        if uniforms is None:
            raise ValueError("uniforms are required when some row samples")
        probs = torch.softmax(masked, dim=-1)
        if params.needs_filter:
            probs, order = probs.sort(dim=-1, descending=True)
            keep = _kept_sorted(probs, params)
            probs = probs * keep
            if banned is None:
                kept = torch.zeros_like(keep).scatter_(1, order, keep)
        cdf = probs.cumsum(dim=-1)
        target = (uniforms * cdf[:, -1])[:, None]
        idx = torch.searchsorted(cdf, target, right=True).clamp_max(probs.shape[-1] - 1)
        sampled = order.gather(1, idx)[:, 0] if params.needs_filter else idx[:, 0]
        tokens = torch.where(params.greedy, greedy_ids, sampled)
    logprobs = tempered_all.gather(1, tokens[:, None])[:, 0]
    if not params.needs_filter:
        truncated = logprobs
    else:
        if kept is None:
            unbanned, order = tempered_all.exp().sort(dim=-1, descending=True)
            keep = _kept_sorted(unbanned, params)
            kept = torch.zeros_like(keep).scatter_(1, order, keep)
        kept = kept.scatter(1, tokens[:, None], True)  # a hidden-token edge case must stay finite
        mass = (tempered_all.exp() * kept).sum(dim=-1)
        truncated = logprobs - mass.log()
    truncated = torch.where(params.greedy, torch.zeros_like(truncated), truncated)
    return SampledTokens(tokens, logprobs, truncated)
