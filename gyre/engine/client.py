"""One client for every rollout engine that speaks SGLang's native HTTP protocol.

The embedded CPU engine (gyre.engine.server) and production SGLang servers are driven by this
same class; payloads follow sglang/srt/managers/io_struct.py (GenerateReqInput).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp

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

    def to_payload(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
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

    @classmethod
    def from_response(cls, body: dict[str, Any]) -> GenerateResult:
        meta = body["meta_info"]
        finish = meta.get("finish_reason") or {}
        lps = meta.get("output_token_logprobs") or []
        ids = body.get("output_ids")
        if ids is None:
            ids = [int(tok) for _, tok, *_ in lps]
        return cls(
            rid=str(meta.get("id", "")),
            output_ids=[int(i) for i in ids],
            output_logprobs=[float(lp) for lp, *_ in lps],
            finish_reason=str(finish.get("type", "stop")) if isinstance(finish, dict) else str(finish),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            cached_tokens=int(meta.get("cached_tokens", 0)),
            weight_version=str(meta.get("weight_version", "")),
        )


class EngineClient:
    """Async client; create inside a running event loop, close with `await client.close()`.

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

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str | None = None) -> GenerateResult:
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": sampling.to_payload(),
            "return_logprob": True,
            "stream": False,
        }
        if rid is not None:
            payload["rid"] = rid
        return GenerateResult.from_response(await self._request("POST", "/generate", payload))

    async def health(self) -> bool:
        try:
            await self._request("GET", "/health")
            return True
        except EngineError:
            return False

    async def server_info(self) -> dict[str, Any]:
        return await self._request("GET", "/get_server_info")

    async def health_generate(self) -> bool:
        """True once the engine produced a token (SGLang runs a one-token request unless it is busy)."""
        try:
            await self._request("GET", "/health_generate")
            return True
        except EngineError:
            return False

    async def model_info(self) -> dict[str, Any]:
        return await self._request("GET", "/get_model_info")

    async def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort one request (rid; SGLang matches it as a prefix) or, with abort_all, every request."""
        payload: dict[str, Any] = {"rid": rid}
        if abort_all:
            payload["abort_all"] = True
        await self._request("POST", "/abort_request", payload)

    async def pause_generation(self, mode: str = "in_place") -> None:
        """SGLang modes: "in_place" keeps requests and their KV; "retract" re-queues them (KV may be
        recomputed); "abort" finishes them. SGLang's own default is "abort", so always send one."""
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._request("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache", {})

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """Free GPU memory for a role switch; tags ("weights", "kv_cache") pick what, all by default."""
        await self._request("POST", "/release_memory_occupation", {} if tags is None else {"tags": list(tags)})

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self._request("POST", "/resume_memory_occupation", {} if tags is None else {"tags": list(tags)})

    async def _weight_update(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        body = await self._request("POST", path, payload)
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(f"weight update failed: {body.get('message')}")
        return body

    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> dict[str, Any]:
        payload = {"model_path": model_path, "weight_version": weight_version, "abort_all_requests": False}
        return await self._weight_update("/update_weights_from_disk", payload)

    async def update_weights_from_tensor(
        self, serialized_named_tensors: list[str], weight_version: str, flush_cache: bool = True
    ) -> dict[str, Any]:
        """Same-node update: one base64 payload per TP rank (gyre.engine.sglang_weights.serialize_named_tensors)."""
        payload = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "weight_version": weight_version,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
        }
        return await self._weight_update("/update_weights_from_tensor", payload)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> dict[str, Any]:
        """Join the trainer's broadcast group (trainer rank 0, engine ranks from rank_offset)."""
        payload = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._weight_update("/init_weights_update_group", payload)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        weight_version: str,
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """Receive these tensors by broadcast in the group; the trainer broadcasts them in this order."""
        payload = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
        }
        return await self._weight_update("/update_weights_from_distributed", payload)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        return await self._weight_update("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict[str, Any]:
        payload = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        return await self._weight_update("/update_weight_version", payload)
