"""The embedded rollout engine: SGLang's native HTTP protocol over a small model on CPU.

    python -m gyre.engine.server --model-path DIR --port 0 --num-threads 1

loads an HF-format checkpoint directory (config.json + model.safetensors, tokenizer if present),
serves `/generate`, `/abort_request`, `/pause_generation`, `/continue_generation`,
`/update_weights_from_disk`, `/release_memory_occupation`, `/resume_memory_occupation`,
`/flush_cache`, `/health`, `/health_generate`, `/get_server_info`, `/get_model_info`, and prints
`GYRE_ENGINE_READY <url>` once it accepts requests. The batching loop runs in its own thread
(gyre.engine.batcher); handlers only validate, hand over and wait.

Admin routes (everything but generation, health and info) need `Authorization: Bearer <key>` with the
run's admin key, read at start from the pipe `--admin-key-fd` (gyre.engine.admin_key; else from
GYRE_ENGINE_ADMIN_KEY; without one they are open, as SGLang's are without `--admin-api-key`), and weights load only from the `--weights-dir`
directories (default: the directory of `--model-path`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from gyre.engine.admin_key import ADMIN_KEY_ENV, bearer_matches, read_key_fd
from gyre.engine.batcher import Batcher, BatcherConfig, Delta, Sequence
from gyre.engine.kv_routes import KVRoutes
from gyre.engine.launcher import READY_PREFIX
from gyre.engine.protocol import GenerateItem, ProtocolError, RequestOutput, parse_generate
from gyre.engine.sampling import SamplingSpec
from gyre.model.hf_io import load_hf_state, load_llama
from gyre.model.tokenizer import Tokenizer

log = logging.getLogger("gyre.engine.server")
HEALTH_TIMEOUT_S = 20.0
OPEN_ROUTES = frozenset(
    {"/generate", "/health", "/health_generate", "/get_server_info", "/server_info", "/get_model_info", "/model_info"}
)  # everything else is an admin route


def error_response(message: str, status: int = 400) -> web.Response:
    """SGLang's ErrorResponse shape."""
    kind = {400: "BadRequest", 503: "ServiceUnavailable"}.get(status, "Error")
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.json_response(body, status=status)


async def _json_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object; an empty body counts as {}."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ProtocolError(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    return body


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        raise ProtocolError(f"{name} has the wrong type: {value!r}")
    return value


class EngineServer:
    def __init__(
        self,
        model_path: str,
        config: BatcherConfig,
        weight_version: str = "default",
        served_model_name: str | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        admin_key: str | None = None,
        weights_dirs: list[str | Path] | None = None,
    ) -> None:
        self.model_path = str(model_path)
        self.admin_key = admin_key
        self.weights_dirs = [Path(d).resolve() for d in weights_dirs or [model_path]]
        self.config = config
        self.served_model_name = served_model_name or Path(model_path).name
        model = load_llama(model_path).to(device=device, dtype=getattr(torch, dtype))
        self.model_cfg = model.cfg
        self.param_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        has_tokenizer = (Path(model_path) / "tokenizer.json").exists()
        self.tokenizer = Tokenizer.load(model_path) if has_tokenizer else None
        eos = frozenset() if self.tokenizer is None else frozenset({self.tokenizer.eos_id})
        self.batcher = Batcher(
            model,
            config,
            eos_ids=eos,
            weight_version=weight_version,
            decode_text=None if self.tokenizer is None else partial(self.tokenizer.decode, skip_special_tokens=False),
        )
        self.inflight: dict[str, Sequence] = {}
        self.started = time.time()

    # ----- app -----
    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[self._errors, self._admin_only])
        post, get = web.post, web.get
        both = lambda path, handler: [get(path, handler), post(path, handler)]  # noqa: E731
        app.add_routes(
            [
                post("/generate", self.generate),
                web.put("/generate", self.generate),
                post("/abort_request", self.abort_request),
                post("/pause_generation", self.pause_generation),
                post("/continue_generation", self.continue_generation),
                post("/update_weights_from_disk", self.update_weights_from_disk),
                post("/update_weight_version", self.update_weight_version),
                *both("/release_memory_occupation", self.release_memory_occupation),
                *both("/resume_memory_occupation", self.resume_memory_occupation),
                *both("/flush_cache", self.flush_cache),
                get("/health", self.health),
                get("/health_generate", self.health_generate),
                get("/get_server_info", self.server_info),
                get("/server_info", self.server_info),
                get("/get_model_info", self.model_info),
                get("/model_info", self.model_info),
            ]
        )
        KVRoutes(self).add_to(app)  # /gyre/kv/*: in-flight sessions' keys/values to other engines (Mooncake)
        app.on_shutdown.append(self._on_shutdown)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ProtocolError as e:
            return error_response(str(e), e.status)

    @web.middleware
    async def _admin_only(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """SGLang's answer to a missing or wrong admin key (sglang/srt/utils/auth.py)."""
        if self.admin_key and request.path not in OPEN_ROUTES:
            if not bearer_matches(request.headers.get("Authorization"), self.admin_key):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    def _check_weights_path(self, path: str) -> None:
        resolved = Path(path).resolve()
        if not any(resolved.is_relative_to(d) for d in self.weights_dirs):
            allowed = ", ".join(str(d) for d in self.weights_dirs)
            raise ValueError(f"model_path {path} is outside the run's weights directories ({allowed}); refused")

    async def _on_shutdown(self, app: web.Application) -> None:
        if self.batcher.alive:  # answer every open request before the handlers are torn down
            await self._call(self.batcher.abort, "", True, "Aborted: server shutting down")

    def _abort_exact(self, rid: str, message: str) -> None:
        self.batcher.call(self.batcher.abort, rid, False, message, True)

    async def _call(self, fn: Any, *args: Any) -> Any:
        if not self.batcher.alive:
            raise ProtocolError("the engine loop is not running", 503)
        return await asyncio.wrap_future(self.batcher.call(fn, *args))

    # ----- generation -----
    def _submit(self, item: GenerateItem, stream: bool) -> tuple[RequestOutput, asyncio.Queue[Delta]]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        seq = Sequence(
            rid=item.rid,
            prompt=item.input_ids,
            spec=item.spec,
            stream=stream,
            routed_from=item.routed_experts_start_len if item.return_routed_experts else -1,
            sink=partial(loop.call_soon_threadsafe, queue.put_nowait),
        )
        self.inflight[item.rid] = seq
        self.batcher.call(self.batcher.submit, seq)
        return RequestOutput(item), queue

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if self.batcher.released:
            return error_response(
                f"memory is released ({sorted(self.batcher.released)}); call /resume_memory_occupation first", 503
            )
        if not self.batcher.alive:
            return error_response("the engine loop is not running", 503)
        req = parse_generate(
            await _json_body(request), self.tokenizer, self.model_cfg.vocab_size, self.config.max_context_tokens
        )
        rids = [item.rid for item in req.items]
        busy = [r for r in rids if r in self.inflight]
        if busy or len(set(rids)) != len(rids):
            raise ProtocolError(f"rids must be unique among requests in flight; repeated: {busy or rids}")
        submitted = [self._submit(item, req.stream) for item in req.items]
        try:
            if req.stream:
                return await self._stream(request, *submitted[0])
            outs = await asyncio.gather(*(self._collect(out, q) for out, q in submitted))
        except (asyncio.CancelledError, ConnectionError):
            for rid in rids:  # the client went away: stop computing for it
                self._abort_exact(rid, "Aborted: client disconnected")
            raise
        finally:
            for rid in rids:
                self.inflight.pop(rid, None)
        for out in outs:
            finish = out.last.finish
            if finish.get("type") == "abort" and (finish.get("status_code") or 0) >= 400:
                return error_response(finish.get("message", "aborted"), finish["status_code"])
        bodies = [out.response(self.tokenizer) for out in outs]
        return web.json_response(bodies if req.is_batch else bodies[0])

    @staticmethod
    async def _collect(out: RequestOutput, queue: asyncio.Queue[Delta]) -> RequestOutput:
        while not out.finished:
            out.add(await queue.get())
        return out

    async def _stream(
        self, request: web.Request, out: RequestOutput, queue: asyncio.Queue[Delta]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        while not out.finished:
            out.add(await queue.get())
            while not out.finished and not queue.empty():  # coalesce what piled up while we wrote
                out.add(queue.get_nowait())
            chunk = json.dumps(out.response(self.tokenizer))
            await resp.write(f"data: {chunk}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ----- control -----
    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        rid = _field(body, "rid", str, "") or ""
        abort_all = _field(body, "abort_all", bool, False) or False
        await self._call(self.batcher.abort, rid, abort_all)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = _field(await _json_body(request), "mode", str, "abort") or "abort"
        try:
            await self._call(self.batcher.pause, mode)
        except ValueError as e:
            raise ProtocolError(str(e)) from e
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await _json_body(request)
        await self._call(self.batcher.resume)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    def _check_state(self, state: dict[str, torch.Tensor], path: str) -> None:
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        if shapes != self.param_shapes:
            missing = sorted(set(self.param_shapes) - set(shapes))[:5]
            extra = sorted(set(shapes) - set(self.param_shapes))[:5]
            wrong = sorted(k for k in set(shapes) & set(self.param_shapes) if shapes[k] != self.param_shapes[k])[:5]
            raise ValueError(
                f"checkpoint {path} does not fit the served model (missing {missing}, unexpected {extra}, "
                f"wrong shape {wrong}); a weight update must keep the architecture"
            )

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        path = _field(body, "model_path", str, None)
        if not path:
            raise ProtocolError("model_path is required")
        version = _field(body, "weight_version", str, None)
        abort_all = _field(body, "abort_all_requests", bool, False) or False
        flush = _field(body, "flush_cache", bool, True)
        try:
            self._check_weights_path(path)
            _, state = await asyncio.to_thread(load_hf_state, path)
            self._check_state(state, path)
            num = await self._call(self.batcher.update_weights, state, version, flush is not False, abort_all)
        except (OSError, ValueError) as e:
            return web.json_response({"success": False, "message": str(e), "num_paused_requests": 0}, status=400)
        self.model_path = path
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": num})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        version = _field(body, "new_version", str, None)
        if not version:
            raise ProtocolError("new_version is required")
        if _field(body, "abort_all_requests", bool, False):
            await self._call(self.batcher.abort, "", True)
        await self._call(self.batcher.set_weight_version, version)
        return web.json_response({"success": True, "message": f"Weight version updated to {version}."})

    async def _memory(self, request: web.Request, fn: Any) -> web.Response:
        body = await _json_body(request) if request.method == "POST" else {}
        tags = _field(body, "tags", list, None)
        try:
            await self._call(fn, tags)
        except ValueError as e:
            raise ProtocolError(str(e)) from e
        return web.Response(status=200)

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        return await self._memory(request, self.batcher.release_memory)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        return await self._memory(request, self.batcher.resume_memory)

    async def flush_cache(self, request: web.Request) -> web.Response:
        await self._call(self.batcher.flush_cache)
        return web.Response(text="Cache flushed.\n")

    # ----- status -----
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.batcher.alive else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        b = self.batcher
        if not b.alive or b.released or b.paused:
            return web.Response(status=503, text="engine loop stopped, paused or memory released\n")
        if b.running and time.time() - b.last_step_time < HEALTH_TIMEOUT_S:
            return web.Response(status=200)
        item = GenerateItem(
            f"HEALTH_CHECK_{time.time_ns()}", [0], SamplingSpec(max_new_tokens=1, temperature=0.0), False, False
        )
        out, queue = self._submit(item, stream=False)
        try:
            await asyncio.wait_for(self._collect(out, queue), HEALTH_TIMEOUT_S)
        except TimeoutError:
            self._abort_exact(item.rid, "Aborted: health check timed out")
            return web.Response(status=503, text="no token within the health timeout\n")
        finally:
            self.inflight.pop(item.rid, None)
        return web.Response(status=200)

    async def server_info(self, request: web.Request) -> web.Response:
        stats = self.batcher.stats()
        return web.json_response(
            {
                "model_path": self.model_path,
                "served_model_name": self.served_model_name,
                "tokenizer_path": self.model_path if self.tokenizer is not None else None,
                "weight_version": self.batcher.weight_version,
                "context_length": self.config.max_context_tokens,
                "max_context_tokens": self.config.max_context_tokens,
                "max_running_requests": self.config.max_running_requests,
                "max_req_input_len": self.config.max_context_tokens - 1,
                "prefix_cache_tokens": self.config.prefix_cache_tokens,
                "num_threads": torch.get_num_threads(),
                "backend": "gyre-embedded",
                "startup_time": self.started,
                "internal_states": [stats],
                **{k: stats[k] for k in ("num_running_reqs", "num_queued_reqs", "paused", "memory_released")},
                "cache": {"kv": stats["kv_cache"], "prefix": stats["prefix_cache"]},
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.model_cfg
        return web.json_response(
            {
                "model_path": self.model_path,
                "served_model_name": self.served_model_name,
                "tokenizer_path": self.model_path if self.tokenizer is not None else None,
                "is_generation": True,
                "weight_version": self.batcher.weight_version,
                "model_type": "qwen3" if cfg.qk_layernorm else "qwen2",
                "architectures": ["Qwen3ForCausalLM" if cfg.qk_layernorm else "Qwen2ForCausalLM"],
                "vocab_size": cfg.vocab_size,
                "num_layers": cfg.num_layers,
                "hidden_size": cfg.hidden_size,
                "eos_token_ids": sorted(self.batcher.eos_ids),
            }
        )


@contextlib.asynccontextmanager
async def running(server: EngineServer, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Start the batching thread and the HTTP site; yields the base URL; stops both on exit."""
    server.batcher.start()
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    try:
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        bound_host, bound_port = runner.addresses[0][:2]
        yield f"http://{bound_host}:{bound_port}"
    finally:
        await runner.cleanup()
        server.batcher.stop()


async def serve(server: EngineServer, host: str, port: int) -> None:
    """Run until SIGTERM/SIGINT; prints the ready line with the bound URL."""
    async with running(server, host, port) as url:
        print(f"{READY_PREFIX} {url}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gyre.engine.server", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="HF-format checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (see the ready line)")
    p.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--max-context-tokens", type=int, default=4096)
    p.add_argument("--prefix-cache-tokens", type=int, default=32768, help="LRU bound of the prefix cache")
    p.add_argument("--prefill-chunk-tokens", type=int, default=512)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--device", default="cpu", help="torch device of the model and KV cache (cpu, cuda, cuda:1)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--weights-dir",
        action="append",
        default=None,
        help="weights load only from under these (repeat; default --model-path)",
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--admin-key-fd", type=int, default=-1, help="read the run's admin key from this pipe")
    args = p.parse_args(argv)
    for name in (
        "num_threads",
        "max_running_requests",
        "max_context_tokens",
        "prefix_cache_tokens",
        "prefill_chunk_tokens",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    torch.set_num_threads(args.num_threads)
    config = BatcherConfig(
        max_running_requests=args.max_running_requests,
        max_context_tokens=args.max_context_tokens,
        prefix_cache_tokens=args.prefix_cache_tokens,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
    )
    admin_key = os.environ.pop(ADMIN_KEY_ENV, None)  # not inherited by anything this process starts
    if args.admin_key_fd >= 0:
        admin_key = read_key_fd(args.admin_key_fd)
    if not admin_key:
        log.warning("no %s in the environment: admin routes are open to anyone who reaches the port", ADMIN_KEY_ENV)
    server = EngineServer(
        args.model_path,
        config,
        args.weight_version,
        args.served_model_name,
        device=args.device,
        dtype=args.dtype,
        admin_key=admin_key,
        weights_dirs=args.weights_dir,
    )
    log.info("serving %s (%s threads)", args.model_path, args.num_threads)
    asyncio.run(serve(server, args.host, args.port))


if __name__ == "__main__":
    main()
