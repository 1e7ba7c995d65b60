"""HTTP plumbing of the proxy that holds under bad input and load: the request body read with a size
limit and a deadline and parsed with a nesting limit, errors the HTTP layer raises itself (a malformed
request line, a content encoding it cannot decode) answered as JSON, and caps on open connections.

Connections are capped proxy-wide and per rollout, and idle connections give way: a connection is
attributed to a rollout by its first request (gyre.proxy.limits); at the proxy-wide cap an idle one
(first one that never sent a request, then the longest idle) is closed for the newcomer, so that one
client holding idle connections cannot lock the others out; only when every connection is busy is a new
one answered 503. Closing an idle kept-alive connection is what HTTP allows a server at any time.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from typing import Any

import pydantic_core
from aiohttp import web
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from gyre.proxy.errors import ProxyError, both_shapes_body, invalid_request

log = logging.getLogger(__name__)


async def read_json(request: web.Request, timeout_s: float) -> Any:
    return parse_json(await read_raw(request, timeout_s))


def parse_json(raw: bytes) -> Any:
    """A request's JSON body. jiter (pydantic's parser) refuses lone UTF-16 surrogates, nesting
    deeper than 200 and trailing data, so what comes back can be rendered, dumped and streamed."""
    try:
        return pydantic_core.from_json(raw, cache_strings="keys")
    except ValueError as e:
        raise invalid_request(f"request body is not valid JSON: {e}") from e


async def read_raw(request: web.Request, timeout_s: float) -> bytes:
    """The request's body, within the size limit and the deadline; not empty."""
    try:
        async with asyncio.timeout(timeout_s):  # no extra task per request, unlike wait_for
            raw = await request.read()
    except TimeoutError as e:
        raise ProxyError(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout") from e
    except RequestPayloadError as e:  # e.g. marked gzip but not gzip: the connection cannot be reused
        request.content.feed_eof()  # nothing more to read (aiohttp would read again, and fail loudly)
        err = invalid_request(f"the request body cannot be read: {e.__cause__ or e}".replace("\n", " "))
        err.close_connection = True
        raise err from e
    except web.HTTPRequestEntityTooLarge as e:
        message = f"request body over the proxy's limit of {request.client_max_size} bytes (proxy.max_body_mb)"
        raise ProxyError(413, message, "invalid_request_error", code="request_too_large") from e
    if not raw.strip():
        raise invalid_request("the request body is empty; send a JSON object")
    return raw


class _JsonErrorRequestHandler(RequestHandler):
    """aiohttp's connection handler, answering its own errors (bad framing, an encoding it cannot decode) as
    JSON readable as both APIs' shape (aiohttp raises them before the request, and so its API, is known),
    logged at debug level only (any client can cause them), closing idle connections for new ones at the
    cap and refusing new connections when none is idle."""

    max_connections = 0  # set per server by JsonErrorServer

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.rollout: str | None = None  # set by the first request (attribute)
        self.evicted = False
        self.active_at = self._loop.time()
        if not self.max_connections or self._manager is None or len(self._manager.connections) <= self.max_connections:
            return
        open_now = self._live_connections()
        if len(open_now) <= self.max_connections or self._evict_idle(open_now, 1):
            return
        log.warning("refusing a connection: %d open, none idle (proxy.max_connections)", len(open_now) - 1)
        body = b'{"type":"error","error":{"type":"overloaded_error","message":"too many connections","param":null,"code":null}}'
        head = f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        transport.write(head.encode() + b"Connection: close\r\nRetry-After: 1\r\n\r\n" + body)
        self.evicted = True
        self.force_close()
        transport.close()

    def _live_connections(self) -> list[_JsonErrorRequestHandler]:
        manager = self._manager
        return [h for h in (manager.connections if manager else []) if not getattr(h, "evicted", True)]

    def is_idle(self) -> bool:
        """No request in progress or queued: waiting for the next one (or for the rest of its headers)."""
        return not self._request_in_progress and not self._messages and not self.evicted

    def _evict_idle(self, among: list[_JsonErrorRequestHandler], count: int) -> bool:
        """Close `count` idle connections of `among` (never this one): those that never sent a request first,
        then the longest idle. False when fewer were idle."""
        idle = [h for h in among if h is not self and h.is_idle()]
        for h in heapq.nsmallest(count, idle, key=lambda h: (h.rollout is not None, h.active_at)):
            h.evicted = True
            h.force_close()
        return len(idle) >= count

    def attribute(self, rollout_id: str, max_per_rollout: int) -> bool:
        """This connection carries `rollout_id`'s requests; False when the rollout holds more than
        `max_per_rollout` connections even after its idle ones are closed."""
        self.rollout, self.active_at = rollout_id, self._loop.time()
        mine = [h for h in self._live_connections() if h.rollout == rollout_id]
        excess = len(mine) - max_per_rollout
        return excess <= 0 or self._evict_idle(mine, excess)

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        log.debug("HTTP-level error %d from %s: %s", status, request.remote, exc)
        if request.writer.output_size > 0:
            raise ConnectionError("the response is under way; cannot send an error now")
        text = (message or (str(exc) if exc else "") or "bad request").strip().replace("\n", " ")
        resp = web.json_response(both_shapes_body(status, text), status=status)
        resp.force_close()
        return resp


class JsonErrorServer(web.Server):
    """aiohttp's Server, with connections handled by `handler_class`."""

    handler_class: type[RequestHandler] = _JsonErrorRequestHandler

    def __call__(self) -> RequestHandler:
        return self.handler_class(self, loop=self._loop, **self._kwargs)


class ProxyAppRunner(web.AppRunner):
    """An AppRunner whose server is a JsonErrorServer (aiohttp has no public hook for its own errors)."""

    def __init__(self, app: web.Application, max_connections: int, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.max_connections = max_connections

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = JsonErrorServer
        attrs = {"max_connections": self.max_connections}
        server.handler_class = type("CappedRequestHandler", (_JsonErrorRequestHandler,), attrs)  # type: ignore[attr-defined]
        return server
