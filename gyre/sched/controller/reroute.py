"""Taking a rollout engine out of service without the harnesses noticing: its in-flight requests continue
on the remaining engines, their keys/values moved ahead of them through Mooncake.

1. the proxy stops routing new requests to it;
2. the engine pauses in place, so its running requests keep their keys/values and nothing moves;
3. their keys/values go to the least-loaded remaining engines (`/gyre/kv/export` there, `/gyre/kv/import`
   here; Mooncake reads them engine to engine) and the proxy learns where each request will continue;
   so do the cached contexts of the sessions whose last call ran there (between calls, running nothing:
   the proxy routes a session back to its engine, gyre.proxy.routing), and their next calls go along;
4. the engine aborts everything: each request returns its partial output to the proxy, which continues
   it from there on the engine that now holds its prefix (gyre.proxy.dispatch), so nothing is recomputed.

Without migration (`sched.kv_migration=false`) step 3 is skipped: the same requests continue elsewhere
by recomputing their prefixes, which the proxy counts (`continued_recomputed_tokens`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gyre.engine.client import SyncEngineClient

if TYPE_CHECKING:
    from gyre.proxy.server import ProxyServer


@dataclass
class Migration:
    source: str
    sessions: int = 0  # running requests whose keys/values moved
    idle_sessions: int = 0  # sessions between calls whose cached context moved
    idle_tokens: int = 0
    tokens: int = 0  # keys/values moved, in tokens
    bytes: int = 0
    would_recompute: int = 0  # tokens the targets lacked: what rerouting without migration would prefill again
    waiting: int = 0  # requests not yet prefilled (nothing to move)
    failed: list[str] = field(default_factory=list)  # per-session errors (the proxy recomputes those)
    seconds: float = 0.0

    def metrics(self) -> dict[str, Any]:
        return {
            "migrated_sessions": self.sessions,
            "migrated_idle_sessions": self.idle_sessions,
            "migrated_idle_tokens": self.idle_tokens,
            "migrated_tokens": self.tokens,
            "migrated_bytes": self.bytes,
            "would_recompute_tokens": self.would_recompute,
            "waiting_rerouted": self.waiting,
            "migration_failures": len(self.failed),
            "migration_s": round(self.seconds, 4),
        }


SESSION_PREFIX = "session:"  # export ids of idle sessions' contexts (running requests use engine rids)


def idle_contexts(source: str, proxy: ProxyServer) -> list[dict[str, Any]]:
    """The contexts (last call's prompt + output) of the sessions whose last call ran on `source`."""
    contexts = []
    for label in proxy.dispatcher.sessions_on(source):
        calls = proxy.call_log.for_rollout(label)
        if calls:
            last = calls[-1]
            contexts.append({"rid": SESSION_PREFIX + label, "token_ids": [*last.input_ids, *last.output_ids]})
    return contexts


def take_out_of_service(source: str, proxy: ProxyServer, migrate_kv: bool = True) -> Migration:
    """Steps 1-4 above for the engine at `source`; the engine stays paused (release its memory next)."""
    start = time.monotonic()
    report = Migration(source)
    targets = [u for u in proxy.engines() if u != source.rstrip("/")]
    proxy.set_engines(targets)
    engine = SyncEngineClient(source, timeout_s=60.0)
    engine.pause_generation("in_place")
    if migrate_kv and targets:
        exported = engine.post("/gyre/kv/export", {"prefixes": idle_contexts(source, proxy)})
        report.waiting = len(exported["waiting"])
        load = proxy.router.in_flight()
        for handle in exported["sessions"]:
            target = min(targets, key=lambda u: load.get(u, 0))
            load[target] = load.get(target, 0) + 1
            (result,) = SyncEngineClient(target, timeout_s=60.0).post("/gyre/kv/import", {"sessions": [handle]})[
                "imported"
            ]
            if "error" in result:
                report.failed.append(f"{result['rid']}: {result['error']}")
                continue
            report.bytes += result["bytes"]
            if result["rid"].startswith(SESSION_PREFIX):
                proxy.dispatcher.move_session(result["rid"].removeprefix(SESSION_PREFIX), target)
                report.idle_sessions += 1
                report.idle_tokens += result["tokens"]
                continue
            proxy.dispatcher.prefer_engine(result["rid"], target)
            report.sessions += 1
            report.tokens += result["tokens"]
            report.would_recompute += result["tokens"] - result["already_cached"]
    engine.abort(abort_all=True)
    if migrate_kv and targets:
        engine.post("/gyre/kv/release")
    report.seconds = time.monotonic() - start
    return report
