"""One model call, independent of the API dialect: render (TITO), fit the context, generate, parse, record."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from gyre.config.schema import ProxyConfig
from gyre.engine.client import SamplingParams
from gyre.model.chat_template import TemplateError, content_text, parse_assistant_text
from gyre.model.tokenizer import Tokenizer
from gyre.proxy.call_log import CallLog, CallRecord
from gyre.proxy.dispatch import EngineDispatcher
from gyre.proxy.errors import context_length_exceeded, invalid_request
from gyre.proxy.tito import RenderedPrompt, TitoRenderer


@dataclass
class GenParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    top_k: int = -1
    min_p: float = 0.0


def cut_at_stop(tokenizer: Tokenizer, output_ids: list[int], stops: list[str]) -> tuple[int, str] | None:
    """(tokens kept, text before the stop string) for the earliest stop string in the output, if any.

    The kept tokens end with the token that completes the stop string: they are what the model
    actually generated up to the stop, so they are what later turns splice back in.
    """
    text = tokenizer.decode(output_ids)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return None
    pos, stop = min(hits)
    end = pos + len(stop)
    lo, hi = 1, len(output_ids)  # smallest prefix whose text reaches past the stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(output_ids[:mid])) >= end and tokenizer.decode(output_ids[:mid])[pos:end] == stop:
            hi = mid
        else:
            lo = mid + 1
    return lo, text[:pos]


class CallRunner:
    def __init__(
        self,
        tokenizer: Tokenizer,
        call_log: CallLog,
        dispatcher: EngineDispatcher,
        cfg: ProxyConfig,
        truncated_logprobs: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.truncated_logprobs = truncated_logprobs  # rl.logprob_distribution=truncated
        self.call_log = call_log
        self.dispatcher = dispatcher
        self.cfg = cfg
        self.renderer = TitoRenderer(tokenizer, call_log)
        self.spliced_turns = 0
        self.retokenized_turns = 0
        self._forced_limits: dict[str, int] = {}

    def force_context_limit(self, rollout_id: str, limit: int | None) -> None:
        """Answer this rollout's prompts over `limit` tokens as too long (None lifts it); it only
        lowers `max_context_tokens`. Drives a harness's compaction path without a long task."""
        if limit is None:
            self._forced_limits.pop(rollout_id, None)
        else:
            self._forced_limits[rollout_id] = limit

    def context_limit(self, rollout_id: str) -> int:
        return min(self.cfg.max_context_tokens, self._forced_limits.get(rollout_id, self.cfg.max_context_tokens))

    def check_length(self, rollout_id: str, messages: list[dict[str, Any]]) -> None:
        """Refuse a prompt that cannot fit before tokenizing it (megabytes take seconds): its text alone
        has at least chars / max_token_chars tokens. Assistant turns are left out: one may be spliced in as
        ids that cover less text than the harness re-sent."""
        chars = sum(len(content_text(m.get("content"))) for m in messages if m.get("role") != "assistant")
        at_least = chars // self.tokenizer.max_token_chars
        limit = self.context_limit(rollout_id)
        if at_least >= limit:
            raise context_length_exceeded(limit, at_least, at_least=True)

    async def render(
        self, rollout_id: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> RenderedPrompt:
        try:
            return await asyncio.to_thread(self.renderer.render, rollout_id, messages, tools)
        except TemplateError as e:
            raise invalid_request(str(e), "messages") from e

    def max_new_tokens(self, prompt_tokens: int, requested: int | None, rollout_id: str = "") -> int:
        limit = self.context_limit(rollout_id)
        if prompt_tokens >= limit:
            raise context_length_exceeded(limit, prompt_tokens)
        wanted = requested if requested is not None else self.cfg.default_max_tokens
        if self.cfg.max_output_tokens is not None:
            wanted = min(wanted, self.cfg.max_output_tokens)
        return min(wanted, limit - prompt_tokens)

    async def run(
        self,
        rollout_id: str,
        api: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        params: GenParams,
        tool_names: list[str] | None = None,
        role: str = "main",
    ) -> CallRecord:
        t_start = time.time()
        self.check_length(rollout_id, messages)
        prompt = await self.render(rollout_id, messages, tools)
        sampling = SamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            max_new_tokens=self.max_new_tokens(len(prompt.input_ids), params.max_tokens, rollout_id),
            stop_token_ids=[self.tokenizer.eos_id],
            seed=params.seed,
            top_k=params.top_k,
            min_p=params.min_p,
            truncated_logprobs=self.truncated_logprobs,
        )
        call_id = self.call_log.next_call_id()
        url, result = await self.dispatcher.generate(prompt.input_ids, sampling, call_id, rollout_id)
        output_ids, logprobs, finish = result.output_ids, result.output_logprobs, result.finish_reason
        cut = cut_at_stop(self.tokenizer, output_ids, params.stop) if params.stop else None
        if cut is not None:
            n, text = cut
            output_ids, logprobs, finish = output_ids[:n], logprobs[:n], "stop"
        else:
            text = self.tokenizer.decode(output_ids)
        content, calls = parse_assistant_text(text)
        record = CallRecord(
            rollout_id=rollout_id,
            call_id=call_id,
            api=api,
            input_ids=prompt.input_ids,
            output_ids=output_ids,
            output_logprobs=logprobs,
            spliced=prompt.spliced,
            finish_reason="tool_calls" if calls and finish == "stop" else finish,
            weight_version=result.weight_version,
            engine_url=url,
            prompt_tokens=len(prompt.input_ids),
            cached_tokens=result.cached_tokens,
            t_start=t_start,
            t_end=time.time(),
            role=role,
            tool_names=list(tool_names or []),
            retokenized_turns=prompt.retokenized_turns,
            content=content,
            tool_calls=calls,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
        )
        self.call_log.add(record)
        self.spliced_turns += len(prompt.spliced)
        self.retokenized_turns += prompt.retokenized_turns
        return record
