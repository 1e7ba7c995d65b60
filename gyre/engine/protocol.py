"""SGLang's native `/generate` payloads: validation of requests and the shape of responses.

Field names follow sglang/srt/managers/io_struct.py (GenerateReqInput) and the meta_info built by
its TokenizerManager. Streaming is SGLang's default non-incremental form: every chunk carries the
whole text, output_ids and logprobs so far.
"""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from gyre.engine.batcher import Delta
from gyre.engine.sampling import SamplingSpec, parse_sampling_params
from gyre.model.tokenizer import Tokenizer

# GenerateReqInput fields that change what must be computed; accepted only at these values.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "input_embeds": (None,),
    "image_data": (None,),
    "video_data": (None,),
    "audio_data": (None,),
    "lora_path": (None,),
    "top_logprobs_num": (None, 0),
    "token_ids_logprob": (None,),
    "logprob_start_len": (None, -1),
    "return_hidden_states": (None, False),
    "custom_logit_processor": (None,),
    "session_params": (None,),
}


class ProtocolError(ValueError):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class GenerateItem:
    rid: str
    input_ids: list[int]
    spec: SamplingSpec
    return_logprob: bool
    return_text_in_logprobs: bool
    return_sampling_mask: bool = False  # SGLang's flag: also answer output_token_sampling_logprobs
    # SGLang's flags: meta_info.routed_experts, base64 int32 [seqlen - 1 - start, MoE layers, top-k] (routing replay)
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0


@dataclass
class GenerateRequest:
    items: list[GenerateItem]
    is_batch: bool
    stream: bool


def _per_item(value: Any, n: int, name: str, is_batch: bool) -> list[Any]:
    if is_batch and isinstance(value, list):
        if len(value) != n:
            raise ProtocolError(f"{name} has {len(value)} entries for a batch of {n} prompts")
        return value
    return [value] * n


def _token_list(ids: Any, vocab_size: int) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise ProtocolError("input_ids must be a non-empty list of token ids")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ProtocolError(f"input_ids contains {t!r}, not a token id in [0, {vocab_size})")
    return ids


def _prompts(body: dict[str, Any], tokenizer: Tokenizer | None, vocab_size: int) -> tuple[list[list[int]], bool]:
    """(the prompts' token ids, whether the body is a batch), from input_ids or text (encoded here)."""
    ids, text = body.get("input_ids"), body.get("text")
    if ids is None and text is None:
        raise ProtocolError("provide input_ids (a list of token ids) or text")
    if ids is not None and text is not None:
        raise ProtocolError("provide either input_ids or text, not both")
    if ids is not None:
        is_batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        return [_token_list(p, vocab_size) for p in (ids if is_batch else [ids])], is_batch
    if tokenizer is None:
        raise ProtocolError("this engine has no tokenizer (none in the model directory); send input_ids")
    is_batch = isinstance(text, list)
    texts = text if is_batch else [text]
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise ProtocolError("text must be a non-empty string or a list of them")
    return [tokenizer.encode(t) for t in texts], is_batch


def _rids(rid: Any, n: int, is_batch: bool) -> list[str]:
    """One request id per prompt: made up, the given one (suffixed by index in a batch), or the batch's list."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rid, str) and rid:
        return [f"{rid}_{i}" for i in range(n)] if is_batch else [rid]
    if is_batch and isinstance(rid, list) and len(rid) == n and all(isinstance(r, str) and r for r in rid):
        return list(rid)
    raise ProtocolError(f"rid must be a non-empty string (or one per prompt in a batch), got {rid!r}")


def parse_generate(body: Any, tokenizer: Tokenizer | None, vocab_size: int, max_context_tokens: int) -> GenerateRequest:
    """Validate a GenerateReqInput body; raises ProtocolError (HTTP 400) naming the problem."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    for name, allowed in _UNSUPPORTED.items():
        if body.get(name) not in allowed:
            raise ProtocolError(f"{name}={body[name]!r} is not supported by the embedded engine")
    prompts, is_batch = _prompts(body, tokenizer, vocab_size)
    n = len(prompts)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ProtocolError(f"stream must be true or false, got {stream!r}")
    if stream and is_batch:
        raise ProtocolError("streaming a batch of prompts is not supported; send one request per prompt")

    rids = _rids(body.get("rid"), n, is_batch)

    try:
        raw_params = _per_item(body.get("sampling_params"), n, "sampling_params", is_batch)
        specs = [parse_sampling_params(p, vocab_size) for p in raw_params]
    except ValueError as e:
        raise ProtocolError(str(e)) from e
    logprob_flags = _per_item(body.get("return_logprob") or False, n, "return_logprob", is_batch)
    text_in_lp = body.get("return_text_in_logprobs", False)
    if not all(isinstance(f, bool) for f in [*logprob_flags, text_in_lp]):
        raise ProtocolError("return_logprob and return_text_in_logprobs must be true or false")
    mask_flags = _per_item(body.get("return_sampling_mask") or False, n, "return_sampling_mask", is_batch)
    if not all(isinstance(f, bool) for f in mask_flags):
        raise ProtocolError("return_sampling_mask must be true or false")
    mode = body.get("sampling_logprobs_mode")
    if mode is not None and not any(mask_flags):
        raise ProtocolError("sampling_logprobs_mode can only be set when return_sampling_mask=true")
    if mode not in (None, "selected"):
        raise ProtocolError(f"sampling_logprobs_mode={mode!r} is not supported by the embedded engine; use 'selected'")

    routed, routed_start = _routed_experts_flags(body)
    items = []
    for prompt, r, spec, lp, mask in zip(prompts, rids, specs, logprob_flags, mask_flags, strict=True):
        if len(prompt) + spec.max_new_tokens > max_context_tokens:
            raise ProtocolError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({spec.max_new_tokens}) exceeds the context "
                f"limit of {max_context_tokens} tokens; shorten the prompt or lower max_new_tokens"
            )
        if not 0 <= routed_start <= len(prompt):
            raise ProtocolError(f"routed_experts_start_len={routed_start} must be in [0, prompt tokens={len(prompt)}]")
        items.append(GenerateItem(r, prompt, spec, lp, text_in_lp, mask, routed, routed_start))
    return GenerateRequest(items, is_batch, stream)


def _routed_experts_flags(body: dict[str, Any]) -> tuple[bool, int]:
    flag, start = body.get("return_routed_experts", False), body.get("routed_experts_start_len", 0)
    if not isinstance(flag, bool) or isinstance(start, bool) or not isinstance(start, int):
        raise ProtocolError("return_routed_experts must be true or false and routed_experts_start_len an integer")
    return flag, start


@dataclass
class RequestOutput:
    """Server-side accumulation of one request's deltas, rendered as SGLang responses."""

    item: GenerateItem
    created: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    truncated_logprobs: list[float] = field(default_factory=list)
    last: Delta | None = None
    routed_experts: bytes = b""  # int32 rows, filled at the finish

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish is not None

    def add(self, delta: Delta) -> None:
        self.output_ids.extend(delta.output_ids)
        self.logprobs.extend(delta.logprobs)
        self.truncated_logprobs.extend(delta.truncated_logprobs)
        self.routed_experts += delta.routed_experts
        self.last = delta

    def text(self, tokenizer: Tokenizer | None) -> str:
        if tokenizer is None:
            return ""
        spec = self.item.spec
        finish = self.last.finish if self.last is not None else None
        matched = (finish or {}).get("matched")
        ids = self.output_ids
        if isinstance(matched, int) and not spec.no_stop_trim and ids and ids[-1] == matched:
            ids = ids[:-1]
        text = tokenizer.decode(ids, skip_special_tokens=spec.skip_special_tokens)
        if isinstance(matched, str) and (pos := text.find(matched)) >= 0:
            text = text[: pos + len(matched)] if spec.no_stop_trim else text[:pos]
        return text

    def response(self, tokenizer: Tokenizer | None) -> dict[str, Any]:
        last = self.last
        finish = last.finish if last is not None else None
        meta: dict[str, Any] = {
            "id": self.item.rid,
            "finish_reason": finish,
            "prompt_tokens": len(self.item.input_ids),
            "weight_version": last.weight_version if last is not None else "",
            "completion_tokens": len(self.output_ids),
            "cached_tokens": last.cached_tokens if last is not None else 0,
        }
        if self.item.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tok, self._token_text(tokenizer, tok)]
                for lp, tok in zip(self.logprobs, self.output_ids, strict=True)
            ]
            meta["output_token_logprobs_length"] = len(self.logprobs)
        if self.item.return_sampling_mask:  # SGLang's selected mode; the kept ids themselves are not sent
            meta["output_token_sampling_logprobs"] = list(self.truncated_logprobs)
        if self.item.return_routed_experts and finish is not None:
            meta["routed_experts"] = base64.b64encode(self.routed_experts).decode("ascii")
        if finish is not None:
            if last.weight_versions:
                meta["weight_versions"] = last.weight_versions
                meta["weight_version"] = last.weight_versions[-1]["version"]
            meta["e2e_latency"] = time.perf_counter() - self.created
        return {"text": self.text(tokenizer), "output_ids": list(self.output_ids), "meta_info": meta}

    def _token_text(self, tokenizer: Tokenizer | None, token: int) -> str | None:
        if not self.item.return_text_in_logprobs or tokenizer is None:
            return None
        return tokenizer.decode([token], skip_special_tokens=False)
