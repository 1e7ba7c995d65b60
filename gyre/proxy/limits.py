"""Per-rollout caps: one rollout's calls and connections cannot take the proxy's capacity from the others.

A POST call is attributed to its rollout (its key, or its path or header id without a key registry) before
its body is read: a call over the rollout's `proxy.max_rollout_requests` in flight, or on a connection over
its `proxy.max_rollout_connections` once the rollout's idle connections are closed, is answered 429 with
Retry-After in the caller's API shape; other rollouts are not touched.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from aiohttp import web

from gyre.proxy.errors import Handler, ProxyError

ROLLOUT_KEY = web.RequestKey("gyre_rollout_id", str)  # where the middleware leaves the call's rollout id on the request


def too_many(message: str, close_connection: bool = False) -> ProxyError:
    err = ProxyError(429, message, "rate_limit_error", None, "rate_limit_exceeded")
    err.retry_after_s = 1
    err.close_connection = close_connection
    return err


class RolloutLimits:
    def __init__(self, rollout_of: Callable[[web.Request], str], max_requests: int, max_connections: int) -> None:
        self.rollout_of = rollout_of
        self.max_requests = max_requests
        self.max_connections = max_connections
        self.in_flight: Counter[str] = Counter()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "POST" or request.match_info.http_exception is not None:  # 404/405 as ever
            return await handler(request)
        rollout_id = self.rollout_of(request)  # a 401 for a call without a live key, before its body is read
        request[ROLLOUT_KEY] = rollout_id
        attribute = getattr(request.protocol, "attribute", None)
        if attribute is not None and not attribute(rollout_id, self.max_connections):
            raise too_many(
                f"rollout {rollout_id!r} holds more than {self.max_connections} busy connections "
                "(proxy.max_rollout_connections); retry on one of them",
                close_connection=True,
            )
        if self.in_flight[rollout_id] >= self.max_requests:
            raise too_many(
                f"rollout {rollout_id!r} has {self.max_requests} calls in flight (proxy.max_rollout_requests); "
                "retry when one has been answered"
            )
        self.in_flight[rollout_id] += 1
        try:
            return await handler(request)
        finally:
            self.in_flight[rollout_id] -= 1
            if not self.in_flight[rollout_id]:
                del self.in_flight[rollout_id]
