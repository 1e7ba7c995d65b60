"""Engine endpoints that move in-flight sessions' keys/values between embedded engines through Mooncake.

- `POST /gyre/kv/export` `{"rids": [...], "prefixes": [{"rid": ..., "token_ids": [...]}, ...]}` (both
  optional; default every running request and no prefix): the running requests' keys/values
  (gyre.comm.kv_migration.export_session_kv) and those the prefix cache holds for each given context
  (sessions between calls: `export_cached_prefix`), each published in this engine's Mooncake Transfer
  Engine; answers `{"sessions": [handle, ...], "waiting": [rid, ...]}`. Pause the engine first
  (`/pause_generation` `in_place`) so that nothing moves meanwhile.
- `POST /gyre/kv/import` `{"sessions": [handle, ...]}`: each handle read one-sidedly from its owner and put
  into this engine's prefix cache; answers per session the tokens imported and how many of them this
  engine had cached already (what recomputing would have cost is the difference), or the error.
- `POST /gyre/kv/release`: drop what this engine published (the first call also starts the transfer engine).

Handles travel as JSON (`handle_to_json`); the transport starts on first use, at the address in
GYRE_KV_HOSTNAME (default 127.0.0.1) with the protocol in GYRE_KV_PROTOCOL (default tcp).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
from aiohttp import web

from gyre.comm.flat import FlatLayout, TensorEntry
from gyre.comm.kv_migration import KVMeta, SessionKV
from gyre.comm.transfer import BufferHandle
from gyre.engine.kv_session import export_cached_prefix, export_session_kv, import_session_kv

if TYPE_CHECKING:
    from gyre.comm.transfer import KVTransport
    from gyre.engine.server import EngineServer


def handle_to_json(h: BufferHandle) -> dict[str, Any]:
    if not isinstance(h.meta, KVMeta):
        raise TypeError(f"handle {h.key!r} carries no KVMeta")
    layout = {"nbytes": h.layout.nbytes, "entries": [asdict(e) for e in h.layout.entries]}
    meta = asdict(h.meta) | {"token_ids": list(h.meta.token_ids)}
    fields = ("key", "version", "owner_rank", "transport", "session", "address")
    return {f: getattr(h, f) for f in fields} | {"layout": layout, "meta": meta}


def handle_from_json(d: dict[str, Any]) -> BufferHandle:
    try:
        entries = tuple(
            TensorEntry(e["name"], e["offset"], tuple(e["shape"]), e["dtype"]) for e in d["layout"]["entries"]
        )
        meta = KVMeta(**(d["meta"] | {"token_ids": tuple(d["meta"]["token_ids"])}))
        layout = FlatLayout(entries, int(d["layout"]["nbytes"]))
        return BufferHandle(
            d["key"], d["version"], layout, d["owner_rank"], d["transport"], d["session"], d["address"], meta
        )
    except (KeyError, TypeError) as e:
        raise ValueError(f"not a KV handle as /gyre/kv/export writes it: {e!r}") from e


class KVRoutes:
    def __init__(self, server: EngineServer) -> None:
        self.server = server
        self._kv: KVTransport | None = None
        self._published: list[BufferHandle] = []

    def add_to(self, app: web.Application) -> None:
        app.add_routes(
            [
                web.post("/gyre/kv/export", self.export),
                web.post("/gyre/kv/import", self.import_),
                web.post("/gyre/kv/release", self.release),
            ]
        )

    def _transport(self) -> KVTransport:
        if self._kv is None:
            from gyre.comm.mooncake_transport import MooncakeTransport
            from gyre.comm.transfer import KVTransport

            hostname = os.environ.get("GYRE_KV_HOSTNAME", "127.0.0.1")
            self._kv = KVTransport(MooncakeTransport(hostname, os.environ.get("GYRE_KV_PROTOCOL", "tcp")))
        return self._kv

    async def _batcher(self, fn: Any, *args: Any) -> Any:
        return await asyncio.wrap_future(self.server.batcher.call(fn, *args))

    async def export(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        wanted = body.get("rids")
        batcher = self.server.batcher

        prefixes = body.get("prefixes") or []

        def export_all() -> tuple[list[SessionKV], list[str]]:
            running = [s for s in batcher.running if s.kv_len > 0 and (wanted is None or s.rid in wanted)]
            waiting = [s.rid for s in [*batcher.waiting, *batcher.running] if s.kv_len == 0]
            cached = [export_cached_prefix(batcher, p["rid"], p["token_ids"]) for p in prefixes]
            return [export_session_kv(batcher, s.rid) for s in running] + [kv for kv in cached if kv], waiting

        sessions, waiting = await self._batcher(export_all)
        transport = await asyncio.to_thread(self._transport)
        handles = [await asyncio.to_thread(transport.publish, kv) for kv in sessions]
        self._published += handles
        return web.json_response({"sessions": [handle_to_json(h) for h in handles], "waiting": waiting})

    async def import_(self, request: web.Request) -> web.Response:
        body = await request.json()
        transport = await asyncio.to_thread(self._transport)
        batcher = self.server.batcher
        results = []
        for raw in body.get("sessions", []):
            handle = handle_from_json(raw)
            rid = handle.meta.rid
            try:
                kv = await asyncio.to_thread(transport.pull, handle)
                tokens = torch.tensor(kv.meta.token_ids)
                cached = await self._batcher(lambda t=tokens: batcher.prefix.match(t, len(t))[0])
                n = await self._batcher(import_session_kv, batcher, kv)
                results.append({"rid": rid, "tokens": n, "already_cached": int(cached), "bytes": kv.nbytes})
            except (ValueError, RuntimeError) as e:
                results.append({"rid": rid, "tokens": 0, "already_cached": 0, "error": f"{type(e).__name__}: {e}"})
        return web.json_response({"imported": results})

    async def release(self, request: web.Request) -> web.Response:
        kv = await asyncio.to_thread(self._transport)  # the first call starts the transfer engine
        for h in self._published:
            kv.release(h)
        self._published = []
        return web.json_response({"released": True})
