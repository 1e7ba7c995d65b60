"""A rollout's own proxy endpoint: an HTTP forwarder from one sandbox to the proxy, run by the runner.

Isolated sandboxes reach it through a Unix socket bound into them (and the launcher's relay on the
sandbox's 127.0.0.1); backend none gets a loopback port. It forwards requests unchanged, streams
answers back, and remembers every failure on the proxy's side (a 5xx answer, or the proxy not
answering): that record, not the harness's own report, is what lets a failed rollout be excluded as
an infrastructure failure rather than scored 0 (gyre/harness/attribution.py). It also counts the
answers and notes each context overflow the proxy answered (its X-Gyre-Context-Limit header), and
whether one came before any answer: the harness's first request alone over the limit.

An endpoint holds at most `max_connections` connections at once (sandbox.relay_connections; fewer when
the trainer's descriptors are short: gyre.sandbox.limits.descriptor_budget): beyond, a connection is
answered HTTP 429 in the API's error shape and closed at once, so a harness that opens hundreds (through
the relay or straight at its socket) exhausts its own allowance, never the trainer's descriptors.

Every endpoint is served from one event loop in its own thread, never the caller's: a stop signal
(gyre.resume.preemption) raises `Preempted` in the main thread wherever it runs, and aiohttp turns an
exception raised inside its request handling into a payload error it only logs, so an endpoint on the
main thread's loop would swallow the stop and let the step finish.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from gyre.proxy.errors import CONTEXT_LIMIT_HEADER
from gyre.sandbox.inside import too_many_connections  # the relay's refusal, word for word

MAX_BODY_BYTES = 256 << 20
DEFAULT_MAX_CONNECTIONS = 64
MADE_S = 0.05  # a connection accepted this recently may not be in the server's own list yet
REFUSED_LINGER_S = 1.0  # a refused connection's longest life
MAX_LINGERING = 16  # refused connections left open for their client to read the 429; beyond, closed at once
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade"}
T = TypeVar("T")
_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _endpoint_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="gyre-endpoints", daemon=True).start()
        return _loop


async def _on_endpoint_loop(coro: Coroutine[Any, Any, T]) -> T:
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, _endpoint_loop()))


class _TooManyConnections(asyncio.Protocol):
    """Answers a connection beyond the cap with a 429 and ends it; it never reaches aiohttp. Its side is
    shut for writing at once but closed only once the client is done or REFUSED_LINGER_S has passed: a
    socket closed before the client has sent its request would fail that send instead of showing the 429."""

    def __init__(self, response: bytes, accept: _CappedAccept, linger: bool) -> None:
        self.response, self.accept, self.linger = response, accept, linger

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self.response)
        if not self.linger or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        asyncio.get_running_loop().call_later(REFUSED_LINGER_S, transport.close)

    def eof_received(self) -> bool:
        return False  # the client is done: close

    def data_received(self, data: bytes) -> None:
        pass  # the request, unread

    def connection_lost(self, exc: Exception | None) -> None:
        self.accept.lingering -= self.linger


class _CappedAccept:
    """The protocol factory of an endpoint's listener: aiohttp's own handler while fewer than `cap`
    connections are open (those in the server's list and those just accepted), else a refusal."""

    def __init__(self, server: web.Server, cap: int) -> None:
        self.server, self.cap = server, cap
        self.just_accepted = 0
        self.refused = 0
        self.lingering = 0  # refused connections not closed yet (at most MAX_LINGERING)

    def __call__(self) -> asyncio.BaseProtocol:
        if len(self.server.connections) + self.just_accepted >= self.cap:
            self.refused += 1
            linger = self.lingering < MAX_LINGERING
            self.lingering += linger
            return _TooManyConnections(too_many_connections(self.cap), self, linger)
        self.just_accepted += 1
        asyncio.get_running_loop().call_later(MADE_S, self._made)
        return self.server()

    def _made(self) -> None:
        self.just_accepted -= 1


class ProxyEndpoint:
    def __init__(
        self, upstream_root: str, unix_path: Path | None = None, max_connections: int = DEFAULT_MAX_CONNECTIONS
    ) -> None:
        self.upstream = upstream_root.rstrip("/").removesuffix("/v1")
        self.unix_path = unix_path
        self.max_connections = max_connections
        self._listener: asyncio.AbstractServer | None = None
        self._accept: _CappedAccept | None = None
        self.url = ""  # http://127.0.0.1:PORT without a Unix socket
        self.failures: list[str] = []
        self.requests = 0
        self.answered = 0  # 2xx answers
        self.context_overflows: list[str] = []  # "<prompt tokens> > <limit>", one per overflow answered
        self.overflow_before_any_answer = False  # the first request(s) alone were over the limit
        self._closing = False
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        await _on_endpoint_loop(self._start())

    async def close(self) -> None:
        """Stop serving; calls still in flight (the harness has ended) are dropped, not counted as failures."""
        self._closing = True
        await _on_endpoint_loop(self._close())

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0)
        )
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        assert self._runner.server is not None
        self._accept = _CappedAccept(self._runner.server, self.max_connections)
        loop = asyncio.get_running_loop()
        if self.unix_path is not None:
            self._listener = await loop.create_unix_server(self._accept, str(self.unix_path))
        else:
            self._listener = await loop.create_server(self._accept, "127.0.0.1", 0)
            self.url = f"http://127.0.0.1:{self._listener.sockets[0].getsockname()[1]}"

    @property
    def refused_connections(self) -> int:
        """Connections answered 429 for being over the cap."""
        return self._accept.refused if self._accept is not None else 0

    async def _close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        self.requests += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        body = await request.read()
        try:
            async with self._session.request(
                request.method, self.upstream + str(request.rel_url), headers=headers, data=body
            ) as up:
                if up.status >= 500:
                    self.failures.append(f"proxy answered HTTP {up.status} to {request.method} {request.path}")
                elif up.status < 300:
                    self.answered += 1
                elif CONTEXT_LIMIT_HEADER in up.headers:
                    self.context_overflows.append(up.headers[CONTEXT_LIMIT_HEADER])
                    self.overflow_before_any_answer |= self.answered == 0
                out = {k: v for k, v in up.headers.items() if k.lower() not in HOP_HEADERS}
                resp = web.StreamResponse(status=up.status, reason=up.reason, headers=out)
                if up.content_length is not None:
                    resp.content_length = up.content_length
                if not await _to_harness(resp.prepare(request)):
                    return resp
                async for chunk in up.content.iter_any():
                    if not await _to_harness(resp.write(chunk)):
                        return resp
                await _to_harness(resp.write_eof())
                return resp
        except aiohttp.ClientError as e:
            if self._closing:  # the rollout has ended: dropped, not a failure, and not an error to print
                return web.Response(status=503, text="the rollout's endpoint is closing")
            self.failures.append(f"proxy unreachable: {type(e).__name__}: {e}")
            error = {"message": f"proxy unreachable: {e}", "type": "server_error", "param": None, "code": None}
            return web.json_response({"error": error}, status=502, dumps=json.dumps)


async def _to_harness(write: Coroutine[Any, Any, None]) -> bool:
    """Send to the harness; False when it has gone away.

    The harness (and whatever the agent runs beside it) owns its end of the connection: dropping it
    is the rollout's doing, never a failure of the proxy, or an agent could have a losing rollout
    excluded instead of scored by resetting its own socket. aiohttp reports that reset as
    `ClientConnectionResetError`, a `ClientError`, so it must be told apart here, before the
    `ClientError` handler that records the proxy's failures sees it.
    """
    try:
        await write
    except ConnectionError:
        return False
    return True
