"""The proxy under bad input and load, against a real embedded engine serving a tiny random model: a client
that goes away frees its engine slot and leaves nothing behind, a prompt of megabytes neither blocks other
calls nor /health, and the HTTP layer's own errors, limits and timeouts answer in the APIs' shapes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gyre.config.schema import ProxyConfig, SandboxConfig
from gyre.config.validate import ConfigValueError
from gyre.engine.admin_key import ADMIN_KEY_ENV, set_run_admin_key, take_run_admin_key
from gyre.engine.client import EngineClient
from gyre.engine.launcher import EngineProcess, start_engine
from gyre.harness.runner import harness_env
from gyre.model.random_model import SHAPES, create_random_model
from gyre.model.tokenizer import Tokenizer
from gyre.proxy.call_log import CallLog
from gyre.proxy.server import ProxyServer
from gyre.sandbox.base import allowlisted_env

pytestmark = pytest.mark.integration
USER = [{"role": "user", "content": "Write the value 42 to answer.txt."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return create_random_model(tmp_path_factory.mktemp("tiny") / "ckpt", SHAPES["qwen3-tiny"], dtype=torch.float32)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[EngineProcess]:
    with start_engine(model_dir, max_running_requests=32, max_context_tokens=4096) as process:
        yield process


@contextlib.contextmanager
def running_proxy(model_dir: Path, urls: list[str], **cfg: object) -> Iterator[ProxyServer]:
    server = ProxyServer(Tokenizer.load(model_dir), urls, ProxyConfig(**cfg), CallLog())
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def engine_call(url: str, method: str, *args: object) -> object:
    client = EngineClient(url)
    try:
        return await getattr(client, method)(*args)
    finally:
        await client.close()


def queued(url: str) -> int:
    info = asyncio.run(engine_call(url, "server_info"))
    return info["num_queued_reqs"] + info["num_running_reqs"]  # type: ignore[index]


def http(url: str, raw: bytes, timeout: float = 30.0) -> tuple[int, dict]:
    """One raw HTTP/1.1 exchange (the request exactly as given); (status, JSON body)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(raw)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = [int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")]
            if length and len(body) >= length[0]:
                break
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.partition(b"\r\n\r\n")[2])


def chat_request(url: str, body: dict, path: str = "/v1/chat/completions") -> bytes:
    payload = json.dumps(body).encode()
    host = url.removeprefix("http://")
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
    )
    return head.encode() + b"\r\n" + payload


def test_engines_started_for_the_run_refuse_admin_calls_without_its_key(engine):
    host = engine.url.removeprefix("http://")
    for path in ("/pause_generation", "/release_memory_occupation", "/update_weights_from_disk", "/gyre/kv/export"):
        status, body = http(
            engine.url, f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 2\r\n\r\n{{}}".encode()
        )
        assert status == 401 and body == {"error": "Unauthorized"}
    assert asyncio.run(engine_call(engine.url, "server_info"))["paused"] is False  # type: ignore[index]


@pytest.mark.unit
def test_the_run_admin_key_stays_out_of_harness_environments(monkeypatch):
    key = take_run_admin_key()
    monkeypatch.setenv(ADMIN_KEY_ENV, "from-the-launcher")
    set_run_admin_key(key)  # what every rank does at start (gyre.sched.launch.job)
    assert ADMIN_KEY_ENV not in os.environ and take_run_admin_key() == key
    # not even a sandbox told to pass the variable through, nor a harness kind's own additions, can get it
    assert ADMIN_KEY_ENV not in allowlisted_env(SandboxConfig(env=[ADMIN_KEY_ENV]))
    assert ADMIN_KEY_ENV not in harness_env("claude_code", "rollout-key", "/run/gyre/harness")


def test_a_client_that_disconnects_frees_its_engine_slot_and_leaves_no_record(model_dir, engine, caplog):
    """The engine is paused, so the call waits there; the client hangs up; the proxy's handler is cancelled
    and aborts the engine request (the queue empties while the engine is still paused), and neither the
    call log nor the logs say anything about the dropped call."""
    caplog.set_level(logging.DEBUG, logger="gyre")
    with running_proxy(model_dir, [engine.url], max_output_tokens=4) as server:
        asyncio.run(engine_call(engine.url, "pause_generation", "in_place"))
        try:
            sock = socket.create_connection(tuple(server.url.removeprefix("http://").split(":")))  # type: ignore[arg-type]
            sock.sendall(chat_request(server.url, {"model": "m", "messages": USER, "max_tokens": 4}))
            deadline = time.monotonic() + 30
            while queued(engine.url) == 0:
                assert time.monotonic() < deadline, "the call never reached the engine"
                time.sleep(0.05)
            caplog.clear()
            sock.close()  # the client goes away
            deadline = time.monotonic() + 30
            while queued(engine.url) > 0:
                assert time.monotonic() < deadline, "the engine still holds the dropped call's slot"
                time.sleep(0.05)
        finally:
            asyncio.run(engine_call(engine.url, "continue_generation"))
        time.sleep(0.3)
        assert len(server.call_log) == 0 and server.router.in_flight() == {engine.url: 0}
        ours = [r for r in caplog.records if r.name.startswith("gyre") and r.levelno >= logging.INFO]
        assert ours == [], [r.getMessage() for r in ours]
        status, body = http(server.url, chat_request(server.url, {"model": "m", "messages": USER}))
        assert status == 200 and len(server.call_log) == 1  # the slot and the proxy serve the next call


def test_a_prompt_of_megabytes_blocks_neither_other_calls_nor_health(model_dir, engine):
    """5 MB in one message: over the context limit it is refused before tokenizing; under a limit large
    enough to take it, its tokenization runs off the event loop while /health and other calls answer."""
    big = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 110_000}]  # ~5 MB
    with running_proxy(model_dir, [engine.url], max_output_tokens=2) as server:
        t0 = time.perf_counter()
        status, body = http(server.url, chat_request(server.url, {"model": "m", "messages": big}))
        refused_s = time.perf_counter() - t0
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        assert "at least" in body["error"]["message"] and refused_s < 2.0, refused_s
    with running_proxy(model_dir, [engine.url], max_output_tokens=2, max_context_tokens=10_000_000) as server:
        result: dict = {}
        worker = threading.Thread(
            target=lambda: result.update(
                big=http(server.url, chat_request(server.url, {"model": "m", "messages": big}), 120)
            )
        )
        worker.start()
        time.sleep(0.2)  # the big body is in and tokenizing
        waits = []
        while worker.is_alive() and len(waits) < 20:
            t0 = time.perf_counter()
            assert http(server.url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200
            status, _ = http(server.url, chat_request(server.url, {"model": "m", "messages": USER, "max_tokens": 1}))
            waits.append(time.perf_counter() - t0)
            assert status == 200
        worker.join(120)
        assert waits, "the big prompt finished before anything else was sent; make it bigger"
        assert max(waits) < 1.5, f"a small call waited {max(waits):.2f} s behind the big prompt"
        # the big prompt fits no 4096-token engine: the engine refuses it, the proxy answers 502 (no hang)
        assert result["big"][0] in (200, 502), result["big"]


def test_http_layer_errors_limits_and_timeouts_answer_in_api_shape(model_dir, engine):
    with running_proxy(model_dir, [engine.url], max_body_mb=1, body_timeout_s=1.0, idle_timeout_s=1.0,
                       max_connections=4) as server:  # fmt: skip
        host = server.url.removeprefix("http://")
        status, body = http(server.url, b"GARBAGE / HTTP/1.1\r\nHost: x\r\n\r\n")  # aiohttp's own 400
        assert status == 400 and body["type"] == "error" and set(body["error"]) == {"message", "type", "param", "code"}
        huge = chat_request(server.url, {"model": "m", "messages": [{"role": "user", "content": "x" * (2 << 20)}]})
        status, body = http(server.url, huge)
        assert status == 413 and body["error"]["code"] == "request_too_large"
        # a body announced and not sent: 408 once body_timeout_s passes
        status, body = http(
            server.url, f"POST /v1/messages HTTP/1.1\r\nHost: {host}\r\nContent-Length: 100\r\n\r\n{{".encode()
        )
        assert status == 408 and body == {
            "type": "error",
            "error": {"type": "timeout_error", "message": body["error"]["message"]},
        }
        # headers never finished: the connection is closed after idle_timeout_s
        with socket.create_connection(tuple(host.split(":")), timeout=10) as s:  # type: ignore[arg-type]
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            t0 = time.monotonic()
            assert s.recv(100) == b"" and time.monotonic() - t0 < 5
        # connections over the cap, when every open one is busy (a body on its way), are answered 503 and closed;
        # the ones within it still work
        held = [socket.create_connection(tuple(host.split(":"))) for _ in range(4)]  # type: ignore[arg-type]
        try:
            for s in held:
                s.sendall(f"POST /v1/messages HTTP/1.1\r\nHost: {host}\r\nContent-Length: 100\r\n\r\n{{".encode())
            time.sleep(0.2)
            with socket.create_connection(tuple(host.split(":")), timeout=10) as s:  # type: ignore[arg-type]
                reply = s.recv(1000)
            assert reply.startswith(b"HTTP/1.1 503") and b"too many connections" in reply
        finally:
            for s in held:
                s.close()
        time.sleep(0.2)
        # idle connections (never a request) give way to a new one: the longest idle is closed for it
        held = [socket.create_connection(tuple(host.split(":")), timeout=10) for _ in range(4)]  # type: ignore[arg-type]
        try:
            time.sleep(0.2)
            assert http(server.url, f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())[0] == 200
            assert held[0].recv(100) == b""  # closed for the newcomer
        finally:
            for s in held:
                s.close()
        time.sleep(0.2)
        assert http(server.url, f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())[0] == 200
        status, body = http(server.url, f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        assert "127.0.0.1" not in json.dumps(body) and body["engines"] == 1  # no internal URLs


@pytest.mark.unit
@pytest.mark.parametrize(
    "key",
    ["max_body_mb", "body_timeout_s", "idle_timeout_s", "max_connections", "max_rollout_requests",
     "max_rollout_connections", "prepare_threads", "token_cache_mb", "max_body_values"],
)  # fmt: skip
def test_proxy_limits_must_be_positive(key):
    with pytest.raises(ConfigValueError, match=f"proxy.{key}=0"):
        ProxyConfig(**{key: 0})
