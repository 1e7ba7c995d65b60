"""The proxy harnesses talk to as if it were an LLM API: OpenAI Chat Completions, OpenAI Responses or
Anthropic Messages in, engine tokens out.

Rollout id: with a key registry (gyre/proxy/keys.py, what a run always uses) the rollout whose key the
call carries; a call without a live key is refused (401, in the API's own error shape), and a path or
header rollout id other than the key's is refused too. Without one (a standalone proxy, tests): path
prefix `/rollout/{rollout_id}/v1/...`, else header `X-Rollout-Id`, else "default".
Bad input and load are held off before any model work: a body size limit (`proxy.max_body_mb`), a
deadline for the body and for idle connections, connection caps proxy-wide and per rollout (idle ones
give way: gyre.proxy.http), a cap on each rollout's calls in flight (gyre.proxy.limits), pydantic request
schemas, prompt length bounds checked before validating and before tokenizing, and all of that work off
the event loop on a few threads (gyre.proxy.calls); a client that goes away cancels its handler, which
aborts its engine request (gyre.proxy.dispatch) and records nothing.
Run standalone with `python -m gyre.proxy.server --tokenizer DIR --engine URL [--engine URL ...]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import threading
import time
import uuid
from functools import partial
from typing import Any

from aiohttp import web

from gyre.config.schema import ProxyConfig
from gyre.model.tokenizer import Tokenizer
from gyre.proxy.anthropic_routes import AnthropicRoutes
from gyre.proxy.call_log import CallLog, CallRecord
from gyre.proxy.calls import CallRunner, GenParams
from gyre.proxy.dispatch import EngineDispatcher
from gyre.proxy.errors import ProxyError, error_middleware
from gyre.proxy.http import ProxyAppRunner, read_raw
from gyre.proxy.keys import KeyRefused, RolloutKeys, presented_keys
from gyre.proxy.limits import ROLLOUT_KEY, RolloutLimits
from gyre.proxy.openai_api import ChatRequest, Reply, completion_body, parse_chat_request, stream_chunks
from gyre.proxy.responses_routes import ResponsesRoutes
from gyre.proxy.roles import chat_call_role
from gyre.proxy.routing import EngineRouter

log = logging.getLogger(__name__)

ROLLOUT_HEADER = "X-Rollout-Id"
DEFAULT_ROLLOUT = "default"


def rollout_id_of(request: web.Request) -> str:
    return claimed_rollout_id(request) or DEFAULT_ROLLOUT


def claimed_rollout_id(request: web.Request) -> str:
    return request.match_info.get("rollout_id") or request.headers.get(ROLLOUT_HEADER) or ""


def keyed_rollout_id(keys: RolloutKeys, request: web.Request) -> str:
    """The rollout of the request's key; a ProxyError (401) when it has no live key or claims another rollout."""
    try:
        rollout_id = keys.rollout_of(presented_keys(request.headers))
    except KeyRefused as e:
        raise ProxyError(401, str(e), "invalid_request_error", None, "invalid_api_key") from e
    claimed = claimed_rollout_id(request)
    if claimed and claimed != rollout_id:
        raise ProxyError(401, f"this API key is not valid for rollout {claimed!r}", "invalid_request_error",
                         None, "invalid_api_key")  # fmt: skip
    return rollout_id


class ProxyServer:
    """An aiohttp app served from a background thread with its own event loop."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        engine_urls: list[str],
        cfg: ProxyConfig,
        call_log: CallLog,
        model_name: str = "gyre-policy",
        truncated_logprobs: bool = False,
        keys: RolloutKeys | None = None,
        routed_experts: tuple[int, int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.keys = keys
        self.cfg = cfg
        self.call_log = call_log
        self.model_name = model_name
        self.router = EngineRouter(engine_urls, cfg.affinity_slack)
        self.dispatcher = EngineDispatcher(self.router, cfg.request_timeout_s)
        self.runner = CallRunner(tokenizer, call_log, self.dispatcher, cfg, truncated_logprobs, routed_experts)
        self.url: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._app_runner: web.AppRunner | None = None

    # ---- engines -------------------------------------------------------------------------
    def set_engines(self, urls: list[str]) -> None:
        """Thread-safe: new requests go to `urls`; requests already running finish where they are."""
        self.router.set_engines(urls)

    def engines(self) -> list[str]:
        return self.router.engines()

    def force_context_limit(self, rollout_id: str, limit: int | None) -> None:
        """Answer this rollout's prompts over `limit` tokens as too long (None lifts it); any thread."""
        self.runner.force_context_limit(rollout_id, limit)  # one dict store: atomic under the GIL

    def rollout_id_of(self, request: web.Request) -> str:
        """The call's rollout (resolved once, by the limits middleware, for POST calls)."""
        if ROLLOUT_KEY in request:
            return request[ROLLOUT_KEY]
        return rollout_id_of(request) if self.keys is None else keyed_rollout_id(self.keys, request)

    # ---- HTTP ----------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        limits = RolloutLimits(self.rollout_id_of, self.cfg.max_rollout_requests, self.cfg.max_rollout_connections)
        app = web.Application(
            middlewares=[error_middleware, limits.middleware], client_max_size=self.cfg.max_body_mb << 20
        )
        self.read_body = partial(read_raw, timeout_s=self.cfg.body_timeout_s)
        anthropic = AnthropicRoutes(self.runner, self.tokenizer, self.rollout_id_of, self.model_name, self.read_body)
        responses = ResponsesRoutes(self.runner, self.rollout_id_of, self.model_name, self.read_body)
        for prefix in ("", "/rollout/{rollout_id}"):
            anthropic.add_to(app, prefix)
            responses.add_to(app, prefix)
            app.router.add_post(f"{prefix}/v1/chat/completions", self.chat_completions)
            app.router.add_get(f"{prefix}/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_cleanup(self, _app: web.Application) -> None:
        await self.dispatcher.close()
        self.runner.body_checker.close()

    async def health(self, _request: web.Request) -> web.Response:
        """Counts only: engine URLs are internal (harnesses must not learn where to reach engines)."""
        in_flight = self.router.in_flight()
        return web.json_response(
            {
                "status": "ok",
                "engines": len(in_flight),
                "in_flight": sum(in_flight.values()),
                "calls": len(self.call_log),
                "spliced_turns": self.runner.spliced_turns,
                "retokenized_turns": self.runner.retokenized_turns,
                "engine_retries": self.dispatcher.retries,
            }
        )

    async def models(self, _request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "gyre"}
        return web.json_response({"object": "list", "data": [model]})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        rollout_id = self.rollout_id_of(request)
        body = await self.read_body(request)
        req = await self.runner.parse(rollout_id, parse_chat_request, body, self.model_name)
        role = chat_call_role(request.headers, req.messages, bool(req.tools))
        record = await self.runner.run(
            rollout_id, "openai", req.messages, req.tools, _gen_params(req), req.tool_names, role
        )
        reply = self._reply(record, req)
        completion_id = f"chatcmpl-{record.call_id}-{uuid.uuid4().hex[:12]}"
        created = int(record.t_start)
        if not req.stream:
            return web.json_response(completion_body(completion_id, created, req.model, reply))
        return await self._stream(request, stream_chunks(completion_id, created, req.model, reply, req.include_usage))

    def _reply(self, record: CallRecord, req: ChatRequest) -> Reply:
        token_logprobs = None
        if req.logprobs:
            pieces = [self.tokenizer.decode([t]) for t in record.output_ids]
            token_logprobs = list(zip(pieces, record.output_logprobs, strict=True))
        return Reply(
            content=record.content,
            tool_calls=record.tool_calls,
            tool_call_ids=record.tool_call_ids,
            finish_reason=record.finish_reason,
            prompt_tokens=record.prompt_tokens,
            completion_tokens=len(record.output_ids),
            cached_tokens=record.cached_tokens,
            token_logprobs=token_logprobs,
        )

    @staticmethod
    async def _stream(request: web.Request, chunks: list[dict[str, Any]]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ---- lifecycle -----------------------------------------------------------------------
    async def _start_site(self) -> str:
        self._app_runner = ProxyAppRunner(
            self.build_app(),
            self.cfg.max_connections,
            access_log=None,
            handler_cancellation=True,  # a client that goes away cancels its call (and its engine request)
            keepalive_timeout=self.cfg.idle_timeout_s,  # also bounds the wait for a request's headers
        )
        await self._app_runner.setup()
        self.runner.body_checker.warm()
        site = web.TCPSite(self._app_runner, self.cfg.host, self.cfg.port)
        await site.start()
        port = self._app_runner.addresses[0][1]
        return f"http://{self.cfg.host}:{port}"

    def start(self, timeout_s: float = 30.0) -> str:
        """Serve from a background thread; returns the base URL (clients use `<url>/v1`)."""
        if self._thread is not None:
            raise RuntimeError("proxy already started; call stop() first")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gyre-proxy", daemon=True)
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start_site(), self._loop).result(timeout_s)
        log.info("proxy serving on %s with engines %s", self.url, self.engines())
        return self.url

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._loop is None or self._thread is None:
            return
        if self._app_runner is not None:
            asyncio.run_coroutine_threadsafe(self._app_runner.cleanup(), self._loop).result(timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        self._loop.close()
        self._loop, self._thread, self._app_runner, self.url = None, None, None, None


def _gen_params(req: ChatRequest) -> GenParams:
    return GenParams(
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=req.max_tokens,
        stop=req.stop,
        seed=req.seed,
        tool_calls=req.tool_calls,
        parallel_tool_calls=req.parallel_tool_calls,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Gyre proxy: OpenAI Chat Completions in front of rollout engines")
    p.add_argument("--tokenizer", required=True, help="directory with tokenizer.json")
    p.add_argument("--engine", action="append", default=[], help="engine base URL (repeat for several)")
    p.add_argument("--host", default=ProxyConfig.host)
    p.add_argument("--port", type=int, default=ProxyConfig.port)
    p.add_argument("--max-context-tokens", type=int, default=ProxyConfig.max_context_tokens)
    p.add_argument("--default-max-tokens", type=int, default=ProxyConfig.default_max_tokens)
    p.add_argument("--max-output-tokens", type=int, default=None, help="cap on every call's max_tokens")
    p.add_argument("--request-timeout-s", type=float, default=ProxyConfig.request_timeout_s)
    p.add_argument("--call-log", default=None, help="append every call record to this JSONL file")
    p.add_argument("--model-name", default="gyre-policy")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = ProxyConfig(
        host=args.host,
        port=args.port,
        max_context_tokens=args.max_context_tokens,
        default_max_tokens=args.default_max_tokens,
        max_output_tokens=args.max_output_tokens,
        request_timeout_s=args.request_timeout_s,
    )
    server = ProxyServer(Tokenizer.load(args.tokenizer), args.engine, cfg, CallLog(args.call_log), args.model_name)
    url = server.start()
    print(f"gyre proxy listening on {url} (OpenAI base_url {url}/v1, ANTHROPIC_BASE_URL {url})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set():
        time.sleep(0.5)
    server.stop()


if __name__ == "__main__":
    main()
