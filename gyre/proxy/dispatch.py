"""Send one generation to the least-loaded engine, retrying elsewhere when an engine fails or aborts.

Runs inside the proxy's event loop (EngineClient sessions belong to the loop that made them).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from gyre.engine.client import EngineClient, EngineError, GenerateResult, SamplingParams
from gyre.proxy.errors import ProxyError, engine_failed, engine_timeout, engine_unavailable
from gyre.proxy.routing import EngineRouter

log = logging.getLogger(__name__)


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

    def rid(self, call_id: int, attempt: int, label: str = "") -> str:
        """Engine request id; no rid is a prefix of another (engines abort by rid prefix, as SGLang does)."""
        return f"gyre-{self.tag}-{call_id}.{attempt}-{label}"

    def client(self, url: str) -> EngineClient:
        if url not in self._clients:
            self._clients[url] = EngineClient(url, timeout_s=self.timeout_s)
        return self._clients[url]

    async def close(self) -> None:
        for c in self._clients.values():
            await c.close()
        self._clients.clear()

    async def _generate_on(self, url: str, input_ids: list[int], sampling: SamplingParams, rid: str) -> GenerateResult:
        client = self.client(url)
        try:
            return await client.generate(input_ids, sampling, rid=rid)
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
        self, input_ids: list[int], sampling: SamplingParams, call_id: int, label: str = ""
    ) -> tuple[str, GenerateResult]:
        """(engine url, result) of the first engine that completes; raises ProxyError (5xx) otherwise."""
        tried: list[str] = []
        failure: ProxyError | None = None
        while (url := self.router.acquire(exclude=tried)) is not None:
            tried.append(url)
            if len(tried) > 1:
                self.retries += 1
            try:
                result = await self._generate_on(url, input_ids, sampling, self.rid(call_id, len(tried), label))
            except EngineError as e:
                log.warning("engine %s failed: %s", url, e)
                if not _retryable(e):
                    raise engine_failed(f"engine {url} rejected the request: {e}") from e
                failure = (engine_unavailable if e.status is None else engine_failed)(f"engine {url}: {e}")
                continue
            except TimeoutError as e:
                raise engine_timeout(f"engine {url} did not answer within {self.timeout_s:.0f} s") from e
            finally:
                self.router.release(url)
            if result.finish_reason == "abort":
                log.info("engine %s aborted call %d; retrying on another engine", url, call_id)
                failure = engine_unavailable(f"engine {url} aborted the request")
                continue
            return url, result
        if failure is None:
            raise engine_unavailable("no rollout engine is registered with the proxy; retry later")
        failure.message += f" (tried {len(tried)} engine(s); retry later)"
        raise failure
