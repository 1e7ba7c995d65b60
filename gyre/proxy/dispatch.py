"""Send one generation to an engine (the session's previous one, or the least-loaded: gyre.proxy.routing),
retrying elsewhere when an engine fails or aborts.

Runs inside the proxy's event loop (EngineClient sessions belong to the loop that made them).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import Counter, OrderedDict
from dataclasses import replace

from gyre.engine.client import EngineClient, EngineError, GenerateResult, SamplingParams
from gyre.proxy.errors import ProxyError, engine_failed, engine_timeout, engine_unavailable
from gyre.proxy.routing import EngineRouter

log = logging.getLogger(__name__)
MAX_SESSIONS = 65536  # sessions whose last engine is remembered (least recently used forgotten first)


def _retryable(err: EngineError) -> bool:
    """Unreachable (no status) or a server-side failure; a 4xx would fail the same way elsewhere."""
    return err.status is None or err.status >= 500


class EngineDispatcher:
    def __init__(self, router: EngineRouter, timeout_s: float) -> None:
        self.router = router
        self.timeout_s = timeout_s
        self._clients: dict[str, EngineClient] = {}
        self.tag = uuid.uuid4().hex[:8]  # engines may serve several proxies: rids must not collide
        self.retries = 0
        self._aborts: set[asyncio.Task] = set()
        self._prefer: dict[str, str] = {}  # engine rid -> where it continues if its engine aborts it
        self.continued = 0  # generations continued on another engine from their partial output
        self.continued_recomputed_tokens = 0  # of the tokens that had keys/values on the aborting engine
        self._home: OrderedDict[str, str] = OrderedDict()  # session (label) -> engine of its last call
        # the event loop writes _home, the controller's thread reads it (sessions_on, while taking a cell out of
        # rollout): an OrderedDict iterated while another thread moves an entry raises, so both hold this
        self._home_lock = threading.Lock()
        # routing around engines that fail (counted in the run's metrics): failures by engine, calls that moved
        # on after one, and each engine's failures since its last success (the controller declares an
        # engine that keeps failing, its cell dead: gyre.sched.controller.orchestrator)
        self.engine_failures: Counter[str] = Counter()
        self.routed_around = 0
        self.failing_since_success: Counter[str] = Counter()

    def rid(self, call_id: int, attempt: int, label: str = "") -> str:
        """Engine request id; no rid is a prefix of another (engines abort by rid prefix, as SGLang does)."""
        return f"gyre-{self.tag}-{call_id}.{attempt}-{label}"

    def prefer_engine(self, rid: str, url: str) -> None:
        """If its engine aborts request `rid`, continue it on `url` (its keys/values were moved there); any thread."""
        self._prefer[rid] = url.rstrip("/")

    def client(self, url: str) -> EngineClient:
        if url not in self._clients:
            self._clients[url] = EngineClient(url, timeout_s=self.timeout_s)
        return self._clients[url]

    async def close(self) -> None:
        for c in self._clients.values():
            await c.close()
        self._clients.clear()

    async def _generate_on(
        self, url: str, input_ids: list[int], sampling: SamplingParams, rid: str, routed_experts: bool = False
    ) -> GenerateResult:
        client = self.client(url)
        try:
            return await client.generate(input_ids, sampling, rid=rid, routed_experts=routed_experts)
        except asyncio.CancelledError:
            # The client went away: free the engine's slot instead of generating for nobody.
            task = asyncio.get_running_loop().create_task(self._abort_quietly(client, rid))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)
            raise

    @staticmethod
    async def _abort_quietly(client: EngineClient, rid: str) -> None:
        try:
            await client.abort(rid)
        except EngineError as e:
            log.debug("abort of %s failed: %s", rid, e)

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, call_id: int, label: str = "",
        routed_experts: bool = False,
    ) -> tuple[str, GenerateResult]:  # fmt: skip
        """(engine url, result) of the first engine that completes; raises ProxyError (5xx) otherwise.
        routed_experts: ask for every position's routed experts (rl.routing_replay); a continued call's come from
        the engine that finished it, which ran the whole sequence.

        An engine that aborts a request after generating part of it (a cell leaving rollout) hands the
        partial output back: the generation continues from it on another engine, and the caller gets
        one result, as if nothing had happened."""
        tried: list[str] = []
        failure: ProxyError | None = None
        partial: GenerateResult | None = None  # what aborting engines generated so far
        prefer: str | None = None
        with self._home_lock:
            home = self._home.get(label) if label else None
        while (url := self.router.acquire(exclude=tried, prefer=prefer, home=home)) is not None:
            tried.append(url)
            if len(tried) > 1:
                self.retries += 1
            rid = self.rid(call_id, len(tried), label)
            sent_ids, sent_sampling = input_ids, sampling
            if partial is not None:
                sent_ids = input_ids + partial.output_ids
                sent_sampling = replace(sampling, max_new_tokens=sampling.max_new_tokens - len(partial.output_ids))
            try:
                result = await self._generate_on(url, sent_ids, sent_sampling, rid, routed_experts)
            except EngineError as e:
                log.warning("engine %s failed: %s", url, e)
                if not _retryable(e):
                    raise engine_failed(f"engine {url} rejected the request: {e}") from e
                failure = (engine_unavailable if e.status is None else engine_failed)(f"engine {url}: {e}")
                self.engine_failures[url] += 1
                self.failing_since_success[url] += 1
                self.routed_around += 1
                continue
            except TimeoutError as e:
                raise engine_timeout(f"engine {url} did not answer within {self.timeout_s:.0f} s") from e
            finally:
                self.router.release(url)
            self.failing_since_success.pop(url, None)
            if partial is not None and partial.output_ids:
                self.continued += 1
                self.continued_recomputed_tokens += max(0, len(sent_ids) - 1 - result.cached_tokens)
            prefer = self._prefer.pop(rid, None)
            result = _joined(partial, result, len(input_ids))
            if result.finish_reason == "abort":
                if len(result.output_ids) >= sampling.max_new_tokens:
                    return url, replace(result, finish_reason="length")
                log.info("engine %s aborted call %d; continuing on another engine", url, call_id)
                partial = result
                failure = engine_unavailable(f"engine {url} aborted the request")
                continue
            self._remember(label, url)
            return url, result
        if failure is None:
            raise engine_unavailable("no rollout engine is registered with the proxy; retry later")
        failure.message += f" (tried {len(tried)} engine(s); retry later)"
        raise failure

    def sessions_on(self, url: str) -> list[str]:
        """Sessions whose last call ran on `url` (their contexts are cached there); any thread."""
        url = url.rstrip("/")
        with self._home_lock:
            return [label for label, home in self._home.items() if home == url]

    def move_session(self, label: str, url: str) -> None:
        """Session `label`'s context is now cached on `url` too: send its next call there."""
        with self._home_lock:
            self._home[label] = url.rstrip("/")

    def _remember(self, label: str, url: str) -> None:
        if label:
            with self._home_lock:
                self._home[label] = url
                self._home.move_to_end(label)
                while len(self._home) > MAX_SESSIONS:
                    self._home.popitem(last=False)


def _joined(partial: GenerateResult | None, result: GenerateResult, prompt_tokens: int) -> GenerateResult:
    """`result` continued `partial` (None: nothing before it): one result over the original prompt."""
    if partial is None:
        return result
    return replace(
        result,
        output_ids=partial.output_ids + result.output_ids,
        output_logprobs=partial.output_logprobs + result.output_logprobs,
        prompt_tokens=prompt_tokens,
        cached_tokens=partial.cached_tokens,
        weight_version=partial.weight_version or result.weight_version,
    )
