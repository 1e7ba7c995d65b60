"""Who a broken call is blamed on: a harness that drops its own connection is not a proxy failure.

The endpoint's failure record decides whether a failed rollout is excluded (infrastructure) or
scored (the agent's doing). An agent can reset its harness's socket; if that counted as the proxy
failing, a losing rollout could have itself excluded instead of scored 0.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web

from gyre.harness.endpoint import ProxyEndpoint

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
CHUNK = b"x" * (64 << 10)


async def _serve(
    routes: dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]],
) -> tuple[web.AppRunner, str]:
    """A server in the proxy's place on loopback, POST routes only; its runner and its /v1 URL."""
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_post(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/v1"


async def _upstream(done: asyncio.Event) -> tuple[web.AppRunner, str]:
    """A server in the proxy's place: /v1/stream streams for a long while, /v1/die drops mid-answer."""

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await resp.prepare(request)
            for _ in range(400):
                await resp.write(CHUNK)
                await asyncio.sleep(0.005)
            await resp.write_eof()
        finally:
            done.set()
        return resp

    async def die(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        resp.content_length = 10 * len(CHUNK)
        await resp.prepare(request)
        await resp.write(CHUNK)
        assert request.transport is not None
        request.transport.abort()
        return resp

    return await _serve({"/v1/stream": stream, "/v1/die": die})


async def _harness_reads_then_resets(url: str, path: str) -> int:
    """A harness that reads the start of an answer, then resets its connection (SO_LINGER 0)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{{}}".encode())
    await writer.drain()
    got = len(await asyncio.wait_for(reader.read(4096), 10))
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()
    return got


async def _reset_by_harness() -> list[str]:
    done = asyncio.Event()
    runner, root = await _upstream(done)
    endpoint = ProxyEndpoint(root)
    await endpoint.start()
    try:
        assert await _harness_reads_then_resets(endpoint.url, "/v1/stream") > 0
        # The endpoint gives up the upstream call only after its write to the harness failed, and
        # any failure it records is recorded before that: once the upstream stream ends, it is final.
        await asyncio.wait_for(done.wait(), 20)
        return list(endpoint.failures)
    finally:
        await endpoint.close()
        await runner.cleanup()


async def _proxy_dies_mid_answer() -> list[str]:
    runner, root = await _upstream(asyncio.Event())
    endpoint = ProxyEndpoint(root)
    await endpoint.start()
    try:
        host, port = endpoint.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/die HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        for _ in range(200):
            if endpoint.failures:
                break
            await asyncio.sleep(0.05)
        writer.close()
        return list(endpoint.failures)
    finally:
        await endpoint.close()
        await runner.cleanup()


def test_a_harness_resetting_its_own_connection_is_not_a_proxy_failure() -> None:
    assert asyncio.run(_reset_by_harness()) == []


def test_the_proxy_dropping_an_answer_is_recorded_as_its_failure() -> None:
    failures = asyncio.run(_proxy_dies_mid_answer())
    assert len(failures) == 1 and failures[0].startswith("proxy unreachable"), failures


async def _overflow_after(answers_first: int) -> ProxyEndpoint:
    """An upstream answering /v1/ok with 200 and /v1/long as the proxy answers a context overflow."""
    from gyre.proxy.errors import context_length_exceeded, error_response

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def long(request: web.Request) -> web.Response:
        return error_response(context_length_exceeded(4096, 5000), request)

    runner, root = await _serve({"/v1/ok": ok, "/v1/messages": long})
    endpoint = ProxyEndpoint(root)
    await endpoint.start()
    try:
        import aiohttp

        async with aiohttp.ClientSession() as s:
            for path in ["/v1/ok"] * answers_first + ["/v1/messages"]:
                async with s.post(endpoint.url + path, json={}, headers={"anthropic-version": "2023-06-01"}) as r:
                    body = await r.json()
            assert r.status == 400 and body["error"]["message"] == "prompt is too long: 5000 tokens > 4096 maximum"
        return endpoint
    finally:
        await endpoint.close()
        await runner.cleanup()


def test_the_endpoint_notes_context_overflows_and_whether_any_call_was_answered_before() -> None:
    first = asyncio.run(_overflow_after(0))
    assert (first.context_overflows, first.overflow_before_any_answer, first.failures) == (["5000 > 4096"], True, [])
    later = asyncio.run(_overflow_after(2))
    assert (later.context_overflows, later.overflow_before_any_answer, later.answered) == (["5000 > 4096"], False, 2)


async def _proxy_drops_a_call_while_the_endpoint_closes() -> list[str]:
    """The proxy ends a call (a moved or stopped session) while the rollout's endpoint is closing."""
    held, release = asyncio.Event(), asyncio.Event()

    async def hang(request: web.Request) -> web.StreamResponse:
        held.set()
        await release.wait()
        assert request.transport is not None
        request.transport.abort()
        return web.Response()

    runner, root = await _serve({"/v1/hang": hang})
    endpoint = ProxyEndpoint(root)
    await endpoint.start()
    try:
        host, port = endpoint.url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/hang HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        await asyncio.wait_for(held.wait(), 10)
        closing = asyncio.ensure_future(endpoint.close())
        await asyncio.sleep(0.05)
        release.set()
        await closing
        writer.close()
        return list(endpoint.failures)
    finally:
        await runner.cleanup()


def test_a_call_the_proxy_drops_while_the_endpoint_closes_is_neither_a_failure_nor_a_traceback(caplog) -> None:
    with caplog.at_level(logging.ERROR, logger="aiohttp"):
        assert asyncio.run(_proxy_drops_a_call_while_the_endpoint_closes()) == []
    assert [r.getMessage() for r in caplog.records if r.name.startswith("aiohttp")] == []
