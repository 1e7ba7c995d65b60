"""The one HTTP client for every rollout engine that speaks SGLang's native protocol.

The embedded CPU engine (gyre.engine.server) and production SGLang servers are driven by it; payloads
follow sglang/srt/managers/io_struct.py. Each call is written once (`_EngineAPI`) and has two faces:
`EngineClient` (async, aiohttp: the proxy's event loop) and `SyncEngineClient` (blocking, urllib: the cell
runtime, the launcher's health checks, the switch sequence).
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from gyre.engine.admin_key import admin_headers


class EngineError(RuntimeError):
    """The engine answered with an error or could not be reached."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    top_k: int = -1
    min_p: float = 0.0
    # behaviour logprobs renormalised over the kept set (SGLang's return_sampling_mask) instead of tempered only
    truncated_logprobs: bool = False

    def to_payload(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "max_new_tokens": self.max_new_tokens,
            "stop_token_ids": list(self.stop_token_ids),
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        return out


@dataclass
class GenerateResult:
    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    cached_tokens: int
    weight_version: str
    # with routed_experts=True: int32 expert ids of positions [0, prompt + output - 1), each [MoE layers, top-k]
    # flattened (SGLang's meta_info.routed_experts, base64 of int32); reshape with the model's layers and top-k
    routed_experts: np.ndarray | None = None

    @classmethod
    def from_response(cls, body: dict[str, Any]) -> GenerateResult:
        meta = body["meta_info"]
        finish = meta.get("finish_reason") or {}
        lps = meta.get("output_token_logprobs") or []
        ids = body.get("output_ids")
        if ids is None:
            ids = [int(tok) for _, tok, *_ in lps]
        logprobs = [float(lp) for lp, *_ in lps]
        if "output_token_sampling_logprobs" in meta:  # asked for with return_sampling_mask (selected mode)
            logprobs = [float(lp) for lp in meta["output_token_sampling_logprobs"]]
        return cls(
            rid=str(meta.get("id", "")),
            output_ids=[int(i) for i in ids],
            output_logprobs=logprobs,
            finish_reason=str(finish.get("type", "stop")) if isinstance(finish, dict) else str(finish),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            cached_tokens=int(meta.get("cached_tokens", 0)),
            weight_version=str(meta.get("weight_version", "")),
            routed_experts=_routed_experts(meta.get("routed_experts")),
        )


def _routed_experts(encoded: str | None) -> np.ndarray | None:
    return None if encoded is None else np.frombuffer(base64.b64decode(encoded), dtype=np.int32)


def _check_success(body: Any) -> Any:
    if isinstance(body, dict) and body.get("success") is False:
        raise EngineError(f"weight update failed: {body.get('message')}")
    return body


def _answer(body: Any, then: Callable[[Any], Any] | None, probe: bool) -> Any:
    """What a call returns once the engine answered: True for a probe, else the body read by `then`."""
    if probe:
        return True
    return then(body) if then is not None else body


class _EngineAPI:
    """Every engine call, once: method, path, payload and how to read the answer. A face supplies `_send`,
    which returns the answer (sync face) or a coroutine of it (async face)."""

    base_url: str

    def _send(
        self, method: str, path: str, payload: dict[str, Any] | None = None,
        then: Callable[[Any], Any] | None = None, probe: bool = False,
    ) -> Any:  # fmt: skip
        raise NotImplementedError

    def post(self, path: str, payload: dict[str, Any] | None = None) -> Any:
        """Any POST route (gyre's own /gyre/kv/* routes on the embedded engine)."""
        return self._send("POST", path, payload or {})

    def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None, routed_experts: bool = False
    ) -> Any:
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": sampling.to_payload(),
            "return_logprob": True,
            "stream": False,
        }
        if sampling.truncated_logprobs:
            payload["return_sampling_mask"] = True
        if rid is not None:
            payload["rid"] = rid
        if routed_experts:  # routing replay: every token's experts (SGLang needs --enable-return-routed-experts)
            payload["return_routed_experts"] = True
        return self._send("POST", "/generate", payload, then=GenerateResult.from_response)

    def health(self) -> Any:
        """True when /health answers 200."""
        return self._send("GET", "/health", probe=True)

    def health_generate(self) -> Any:
        """True once the engine produced a token (SGLang runs a one-token request unless it is busy)."""
        return self._send("GET", "/health_generate", probe=True)

    def server_info(self) -> Any:
        return self._send("GET", "/get_server_info")

    def model_info(self) -> Any:
        return self._send("GET", "/get_model_info")

    def abort(self, rid: str = "", abort_all: bool = False) -> Any:
        """Abort one request (rid; SGLang matches it as a prefix) or, with abort_all, every request."""
        payload: dict[str, Any] = {"rid": rid}
        if abort_all:
            payload["abort_all"] = True
        return self._send("POST", "/abort_request", payload)

    def pause_generation(self, mode: str = "in_place") -> Any:
        """SGLang modes: "in_place" keeps requests and their KV; "retract" re-queues them (KV may be
        recomputed); "abort" finishes them. SGLang's own default is "abort", so always send one."""
        return self._send("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> Any:
        return self._send("POST", "/continue_generation", {})

    def flush_cache(self) -> Any:
        return self._send("POST", "/flush_cache", {})

    def clear_hicache_storage(self) -> Any:
        """Empty the store under SGLang's hierarchical cache (a Mooncake store: every engine's, all of it)."""
        return self._send("POST", "/hicache/storage-backend/clear", {})

    def release_memory(self, tags: list[str] | None = None) -> Any:
        """Free GPU memory for a role switch; tags ("weights", "kv_cache") pick what, all by default."""
        return self._send("POST", "/release_memory_occupation", {} if tags is None else {"tags": list(tags)})

    def resume_memory(self, tags: list[str] | None = None) -> Any:
        return self._send("POST", "/resume_memory_occupation", {} if tags is None else {"tags": list(tags)})

    def update_weights_from_disk(self, model_path: str, weight_version: str) -> Any:
        payload = {"model_path": model_path, "weight_version": weight_version, "abort_all_requests": False}
        return self._send("POST", "/update_weights_from_disk", payload, then=_check_success)

    def begin_weight_update(self) -> Any:
        """Open SGLang's weight-update session: it takes /update_weights_from_tensor and _distributed only
        between this and end_weight_update (SchedulerWeightUpdaterManager in SGLang 0.5.23)."""
        return self._send("POST", "/begin_weight_update", {}, then=_check_success)

    def end_weight_update(self) -> Any:
        return self._send("POST", "/end_weight_update", {}, then=_check_success)

    def update_weights_from_tensor(
        self, serialized_named_tensors: list[str], weight_version: str, flush_cache: bool = True
    ) -> Any:
        """Same-node update: one base64 payload per TP rank (gyre.engine.sglang_weights.serialize_named_tensors)."""
        payload = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "weight_version": weight_version,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
        }
        return self._send("POST", "/update_weights_from_tensor", payload, then=_check_success)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> Any:
        """Join the trainer's broadcast group (trainer rank 0, engine ranks from rank_offset)."""
        payload = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return self._send("POST", "/init_weights_update_group", payload, then=_check_success)

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        weight_version: str,
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> Any:
        """Receive these tensors by broadcast in the group; the trainer broadcasts them in this order (with
        load_format="flattened_bucket", all of them as one byte buffer)."""
        payload = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
        }
        if load_format:
            payload["load_format"] = load_format
        return self._send("POST", "/update_weights_from_distributed", payload, then=_check_success)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> Any:
        return self._send("POST", "/destroy_weights_update_group", {"group_name": group_name}, then=_check_success)

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> Any:
        payload = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        return self._send("POST", "/update_weight_version", payload, then=_check_success)


class EngineClient(_EngineAPI):
    """Async face; create inside a running event loop, close with `await client.close()`.

    Sends the run's engine admin key (gyre.engine.admin_key), or `admin_key`, with every request."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, admin_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._headers = admin_headers(admin_key)
        self._session: aiohttp.ClientSession | None = None

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        session = await self._http()
        try:
            async with session.request(method, f"{self.base_url}{path}", json=payload) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise EngineError(f"{method} {path} -> {resp.status}: {text[:500]}", resp.status)
                if resp.content_type == "application/json":
                    return await resp.json()
                return text
        except aiohttp.ClientError as e:
            raise EngineError(f"{method} {path} failed: {e}") from e

    async def _send(
        self, method: str, path: str, payload: dict[str, Any] | None = None,
        then: Callable[[Any], Any] | None = None, probe: bool = False,
    ) -> Any:  # fmt: skip
        try:
            body = await self._request(method, path, payload)
        except EngineError:
            if probe:
                return False
            raise
        return _answer(body, then, probe)


class SyncEngineClient(_EngineAPI):
    """Blocking face (urllib): no session to close, usable from any thread; sends the admin key as the async
    face does."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, admin_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = admin_headers(admin_key)

    def _request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(f"{self.base_url}{path}", data=data, method=method, headers=self._headers)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                body, content_type = resp.read(), resp.headers.get_content_type()
        except urllib.error.HTTPError as e:
            raise EngineError(f"{method} {path} -> {e.code}: {e.read()[:500].decode(errors='replace')}", e.code) from e
        except (urllib.error.URLError, OSError) as e:
            raise EngineError(f"{method} {self.base_url}{path} failed: {e}") from e
        text = body.decode(errors="replace")
        return json.loads(text) if content_type == "application/json" and text.strip() else text

    def _send(
        self, method: str, path: str, payload: dict[str, Any] | None = None,
        then: Callable[[Any], Any] | None = None, probe: bool = False,
    ) -> Any:  # fmt: skip
        try:
            body = self._request(method, path, payload)
        except EngineError:
            if probe:
                return False
            raise
        return _answer(body, then, probe)
