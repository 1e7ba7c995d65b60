"""The embedded engine's side of KV migration: a session's keys/values out of this engine's cache and
into another one's prefix cache (the transports move them as gyre.comm.kv_migration.SessionKV).

The engine keeps a running request's keys/values in its slot of `SlotKVCache`
([layers, slots, kv_heads, capacity, head_dim]); the first `kv_len` positions hold the request's
`tokens()[:kv_len]` (the last sampled token is not fed back yet). `export_session_kv` copies those
out with the token ids; `import_session_kv` puts them into another engine's prefix cache, so that
when the rerouted request (the same tokens plus the last one) arrives there, admission matches all
`kv_len` tokens and prefills only the new one: nothing is recomputed.

The batcher-level functions touch engine state: run them in the batcher thread, e.g.
`batcher.call(export_session_kv, batcher, rid).result()`.
"""

from __future__ import annotations

import torch

from gyre.comm.kv_migration import KVMeta, SessionKV
from gyre.engine.batcher import Batcher
from gyre.engine.kv_cache import SlotKVCache


def _check_geometry(cache: SlotKVCache, meta: KVMeta) -> None:
    here = (cache.num_layers, cache.kv_heads, cache.head_dim)
    there = (meta.num_layers, meta.kv_heads, meta.head_dim)
    if here != there:
        raise ValueError(
            f"session {meta.rid}: KV of (layers, kv_heads, head_dim) {there} cannot go into a {here} cache"
        )


# ----- the slot cache -----
def read_slot_kv(
    cache: SlotKVCache, slot: int, token_ids: list[int] | tuple[int, ...], rid: str, weight_version: str
) -> SessionKV:
    """A copy of the first len(token_ids) positions of a slot."""
    k, v = cache.read(slot, len(token_ids))
    meta = KVMeta(
        rid, tuple(token_ids), cache.num_layers, cache.kv_heads, cache.head_dim, str(k.dtype).removeprefix("torch."),
        weight_version,
    )  # fmt: skip
    return SessionKV(meta, k, v)


def write_slot_kv(cache: SlotKVCache, slot: int, kv: SessionKV) -> None:
    """Put a session's keys/values at the start of a slot (growing the cache if needed)."""
    _check_geometry(cache, kv.meta)
    cache.ensure(max(slot + 1, cache.slots), len(kv.meta.token_ids))
    cache.load(slot, kv.k, kv.v)


# ----- the engine (run in the batcher thread) -----
def export_session_kv(batcher: Batcher, rid: str) -> SessionKV:
    """The keys/values of running request `rid` on this engine."""
    seq = next((s for s in batcher.running if s.rid == rid), None)
    if seq is None or seq.kv_len == 0:
        where = "waiting" if any(s.rid == rid for s in batcher.waiting) else "unknown"
        raise KeyError(f"request {rid!r} is {where}: only running requests have keys/values to export")
    return read_slot_kv(batcher.cache, seq.slot, seq.tokens()[: seq.kv_len], rid, batcher.weight_version)


def export_cached_prefix(batcher: Batcher, rid: str, token_ids: list[int]) -> SessionKV | None:
    """The keys/values this engine's prefix cache holds for the longest cached prefix of `token_ids`
    (a session between calls: its context is cached, nothing runs); None if nothing is cached."""
    n, k, v = batcher.prefix.match(torch.tensor(token_ids), len(token_ids))
    if n == 0 or k is None or v is None:
        return None
    cache = batcher.cache
    meta = KVMeta(
        rid, tuple(token_ids[:n]), cache.num_layers, cache.kv_heads, cache.head_dim, str(k.dtype).removeprefix("torch."),
        batcher.weight_version,
    )  # fmt: skip
    return SessionKV(meta, k.clone(), v.clone())


def import_session_kv(batcher: Batcher, kv: SessionKV) -> int:
    """Offer a session's keys/values to this engine's prefix cache; returns the tokens they cover."""
    _check_geometry(batcher.cache, kv.meta)
    if kv.meta.weight_version != batcher.weight_version:
        raise ValueError(
            f"session {kv.meta.rid}: KV computed by weights {kv.meta.weight_version!r}, this engine serves "
            f"{batcher.weight_version!r}; update this engine's weights first or let it recompute the prefix"
        )
    if "kv_cache" in batcher.released:
        raise ValueError("this engine's KV cache is released; call /resume_memory_occupation first")
    n = len(kv.meta.token_ids)
    if n > batcher.prefix.max_tokens:
        raise ValueError(f"session {kv.meta.rid}: {n} tokens exceed the prefix cache ({batcher.prefix.max_tokens})")
    batcher.prefix.insert(torch.tensor(kv.meta.token_ids), kv.k.clone(), kv.v.clone())
    return n
