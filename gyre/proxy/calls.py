"""One model call, independent of the API dialect: render (TITO), fit the context, generate, parse, record.

Everything before the engine that grows with the request (validating a large body, rendering, tokenizing)
runs on a few worker threads (`proxy.prepare_threads`), never on the event loop, and a prompt that cannot
fit the context is refused from lower bounds before that work: first from its number of messages and
tools (`refuse_by_count`, before validation), then from the length of its text (`PromptPlan.min_tokens`,
before tokenizing).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from array import array
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gyre.config.schema import ProxyConfig
from gyre.engine.client import GenerateResult, SamplingParams
from gyre.model.chat_template import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    TemplateError,
    parse_assistant_text,
    reply_text,
)
from gyre.model.tokenizer import Tokenizer
from gyre.proxy.body_check import LARGE_BODY_BYTES, BodyChecker
from gyre.proxy.call_log import CallLog, CallRecord, encode_routed_experts
from gyre.proxy.dispatch import EngineDispatcher
from gyre.proxy.errors import ProxyError, context_length_exceeded, engine_failed, invalid_request
from gyre.proxy.http import parse_json
from gyre.proxy.tito import RenderedPrompt, TitoRenderer

log = logging.getLogger(__name__)
T = TypeVar("T")
# every message renders at least its two special tokens (start and end of turn; the first may merge into the
# system block), every tool at least one (its name, one line of the tools block)
MIN_TOKENS_PER_MESSAGE = 2
SMALL_BODY_ITEMS = 256  # messages + tools of a body validated on the event loop (more: on a worker thread)


@dataclass
class GenParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    top_k: int = -1
    min_p: float = 0.0
    # False for tool_choice "none" (every API): the reply is text, tool-call markup included, never a tool call
    tool_calls: bool = True
    # False for parallel_tool_calls=false: the output ends with its first tool call (cut as a stop string is)
    parallel_tool_calls: bool = True


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


def item_counts(body: Any) -> tuple[int, int]:
    """(messages, tools) of a parsed body, each 0 when not a list (validation will say what is wrong); the
    messages of a Responses body are its `input` items."""
    if not isinstance(body, dict):
        return 0, 0
    messages, tools = body.get("messages", body.get("input")), body.get("tools")
    return len(messages) if isinstance(messages, list) else 0, len(tools) if isinstance(tools, list) else 0


class SlotsPerKey:
    """At most `limit` holders of a slot per key at once (event-loop side; a key's semaphore lives while used)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._semaphores: dict[str, asyncio.Semaphore] = {}
        self._users: Counter[str] = Counter()

    @contextlib.asynccontextmanager
    async def slot(self, key: str) -> AsyncIterator[None]:
        semaphore = self._semaphores.setdefault(key, asyncio.Semaphore(self.limit))
        self._users[key] += 1
        try:
            async with semaphore:
                yield
        finally:
            self._users[key] -= 1
            if not self._users[key]:
                del self._users[key], self._semaphores[key]


class CallRunner:
    def __init__(
        self,
        tokenizer: Tokenizer,
        call_log: CallLog,
        dispatcher: EngineDispatcher,
        cfg: ProxyConfig,
        truncated_logprobs: bool = False,
        routed_experts: tuple[int, int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # rl.routing_replay: (MoE layers, top-k) of the model; every call asks the engine for its routed experts
        self.routed_experts = routed_experts
        self.truncated_logprobs = truncated_logprobs  # rl.logprob_distribution=truncated
        self.call_log = call_log
        self.dispatcher = dispatcher
        self.cfg = cfg
        self.renderer = TitoRenderer(tokenizer, call_log, cfg.token_cache_mb << 20)
        self.pool = ThreadPoolExecutor(cfg.prepare_threads, thread_name_prefix="gyre-proxy-prepare")
        self.body_checker = BodyChecker(min(2, cfg.prepare_threads))
        self._rollout_threads = SlotsPerKey(max(1, cfg.prepare_threads // 2))
        self.spliced_turns = 0
        self.retokenized_turns = 0
        self._forced_limits: dict[str, int] = {}

    def derived_seed(self, rollout_id: str, input_ids: list[int]) -> int | None:
        """proxy.sampling_seed's seed for a call that sent none: a hash of the run's seed, the rollout and the
        prompt's ids, so a rerun samples what the first run did whatever order the calls arrive in."""
        if self.cfg.sampling_seed is None:
            return None
        digest = hashlib.blake2b(f"{self.cfg.sampling_seed}/{rollout_id}/".encode(), digest_size=4)
        digest.update(array("q", input_ids).tobytes())
        return int.from_bytes(digest.digest(), "little") >> 1

    def force_context_limit(self, rollout_id: str, limit: int | None) -> None:
        """Answer this rollout's prompts over `limit` tokens as too long (None lifts it); it only
        lowers `max_context_tokens`. Drives a harness's compaction path without a long task."""
        if limit is None:
            self._forced_limits.pop(rollout_id, None)
        else:
            self._forced_limits[rollout_id] = limit

    def context_limit(self, rollout_id: str) -> int:
        return min(self.cfg.max_context_tokens, self._forced_limits.get(rollout_id, self.cfg.max_context_tokens))

    def refuse_by_count(self, rollout_id: str, n_messages: int, n_tools: int) -> None:
        """Refuse a body whose messages and tools alone cannot fit, before validating it (131K messages take
        seconds to validate): each renders at least a token or two, whatever it holds."""
        at_least = MIN_TOKENS_PER_MESSAGE * max(0, n_messages - 1) + n_tools
        limit = self.context_limit(rollout_id)
        if at_least >= limit:
            raise context_length_exceeded(limit, at_least, at_least=True)

    async def off_loop(self, rollout_id: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on one of the proxy's worker threads (`proxy.prepare_threads`), of which one rollout
        holds half at most: the others' calls keep threads while one rollout sends megabytes."""
        async with self._rollout_threads.slot(rollout_id):
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def parse(self, rollout_id: str, parse: Callable[[Any, str], T], raw: bytes, model_name: str) -> T:
        """`parse(body, model_name)` of the JSON body `raw`: refused by `refuse_by_count` or validated. A large
        body is measured in a helper process first (gyre.proxy.body_check) and parsed here only if it passes;
        one of many messages or tools is validated on a worker thread (pydantic holds the GIL while it
        validates: the parsers validate long lists in slices)."""
        if len(raw) >= LARGE_BODY_BYTES:
            await self.check_large_body(rollout_id, raw)
        body = parse_json(raw)
        n_messages, n_tools = item_counts(body)
        self.refuse_by_count(rollout_id, n_messages, n_tools)
        if n_messages + n_tools <= SMALL_BODY_ITEMS:
            return parse(body, model_name)
        return await self.off_loop(rollout_id, parse, body, model_name)

    async def check_large_body(self, rollout_id: str, raw: bytes) -> None:
        limit = self.context_limit(rollout_id)
        try:
            shape = await self.off_loop(rollout_id, self.body_checker.shape, raw, 2 * limit)
        except (OSError, ValueError) as e:  # the helper died (it is replaced): parse here, as for a small body
            log.warning("could not measure a body of %d bytes in a helper process: %s", len(raw), e)
            return
        if shape.error:
            raise invalid_request(f"request body is not valid JSON: {shape.error}")
        self.refuse_by_count(rollout_id, shape.messages, shape.tools)
        if shape.values > self.cfg.max_body_values:
            message = f"request body of {shape.values} JSON values; the proxy takes {self.cfg.max_body_values} at most"
            raise ProxyError(
                413, message + " (proxy.max_body_values)", "invalid_request_error", None, "request_too_large"
            )

    def prepare(
        self, rollout_id: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, limit: int
    ) -> RenderedPrompt:
        """The prompt's ids; a prompt whose text alone cannot fit `limit` is refused before tokenizing.
        Assistant turns the proxy produced count as their ids: one may be spliced in as ids that cover less
        text than the harness re-sent. Runs on a worker thread."""
        try:
            plan = self.renderer.plan(rollout_id, messages, tools)
        except TemplateError as e:
            raise invalid_request(str(e), "messages") from e
        at_least = plan.min_tokens(self.tokenizer.max_token_chars)
        if at_least >= limit:
            raise context_length_exceeded(limit, at_least, at_least=True)
        return self.renderer.encode(plan)

    async def render(
        self, rollout_id: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> RenderedPrompt:
        """The prompt's ids, rendered off the event loop; refused early when it cannot fit the rollout's context."""
        limit = self.context_limit(rollout_id)
        return await self.off_loop(rollout_id, self.prepare, rollout_id, messages, tools, limit)

    def max_new_tokens(self, prompt_tokens: int, requested: int | None, rollout_id: str = "") -> int:
        limit = self.context_limit(rollout_id)
        if prompt_tokens >= limit:
            raise context_length_exceeded(limit, prompt_tokens)
        wanted = requested if requested is not None else self.cfg.default_max_tokens
        if self.cfg.max_output_tokens is not None:
            wanted = min(wanted, self.cfg.max_output_tokens)
        return min(wanted, limit - prompt_tokens)

    def call_routing(self, url: str, result: GenerateResult, positions: int) -> tuple[str, list[int]]:
        """The call's routed experts as its record keeps them, for its first `positions` positions (a stop string
        cuts the output) as far as the engine ran them; an engine that returns none fails the call."""
        assert self.routed_experts is not None
        if result.routed_experts is None:
            raise engine_failed(f"engine {url} returned no routed experts (rl.routing_replay needs them: SGLang "
                                "--enable-return-routed-experts, a mixture-of-experts model)")  # fmt: skip
        return encode_routed_experts(result.routed_experts.reshape(-1, *self.routed_experts)[:positions])

    def sampling(self, input_ids: list[int], params: GenParams, rollout_id: str) -> SamplingParams:
        """The engine's sampling parameters for a call: the request's, its output bounded by the context limit, its
        seed the request's or one derived from the rollout and the prompt (a rerun samples the same)."""
        return SamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            max_new_tokens=self.max_new_tokens(len(input_ids), params.max_tokens, rollout_id),
            stop_token_ids=[self.tokenizer.eos_id],
            seed=params.seed if params.seed is not None else self.derived_seed(rollout_id, input_ids),
            top_k=params.top_k,
            min_p=params.min_p,
            truncated_logprobs=self.truncated_logprobs,
        )

    def answered(self, result: GenerateResult, params: GenParams) -> tuple[list[int], list[float], str, str]:
        """(output ids, logprobs, finish reason, text) of the engine's answer as the client gets it: cut at the
        first stop string, and after the first tool call when parallel tool calls are off."""
        output_ids, logprobs, finish = result.output_ids, result.output_logprobs, result.finish_reason
        cut = cut_at_stop(self.tokenizer, output_ids, params.stop) if params.stop else None
        if cut is not None:
            n, text = cut
            output_ids, logprobs, finish = output_ids[:n], logprobs[:n], "stop"
        else:
            text = self.tokenizer.decode(output_ids)
        if params.tool_calls and not params.parallel_tool_calls and text.count(TOOL_CALL_START) > 1:
            n, before = cut_at_stop(self.tokenizer, output_ids, [TOOL_CALL_END]) or (len(output_ids), text)
            output_ids, logprobs, finish, text = output_ids[:n], logprobs[:n], "stop", before + TOOL_CALL_END
        return output_ids, logprobs, finish, text

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
        prompt = await self.render(rollout_id, messages, tools)
        sampling = self.sampling(prompt.input_ids, params, rollout_id)
        call_id = self.call_log.next_call_id()
        t_sent = time.time()
        url, result = await self.dispatcher.generate(
            prompt.input_ids, sampling, call_id, rollout_id, routed_experts=self.routed_experts is not None
        )
        t_answered = time.time()
        output_ids, logprobs, finish, text = self.answered(result, params)
        content, calls = parse_assistant_text(text) if params.tool_calls else (reply_text(text), [])
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
            t_sent=t_sent,
            t_answered=t_answered,
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
        if self.routed_experts is not None:
            positions = len(prompt.input_ids) + len(output_ids)
            record.routed_experts, record.routed_experts_shape = self.call_routing(url, result, positions)
        self.call_log.add(record)
        self.spliced_turns += len(prompt.spliced)
        self.retokenized_turns += prompt.retokenized_turns
        return record
