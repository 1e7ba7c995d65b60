"""The run's engine admin key: what unlocks an engine's admin routes (weights, memory, pause and
continue, abort, flush, KV moves), held by the controller and the cells only, never by a harness.

Made once per run: rank 0 of the cell job makes it (`take_run_admin_key`) and broadcasts it to the
cells over MPI (`set_run_admin_key`); a single-process run makes its own. It lives in memory, out of the
environment (so the harnesses a process starts do not inherit it); engines get it in theirs
(`admin_env`, gyre.engine.launcher), and every EngineClient sends it. The embedded engine checks it as
`Authorization: Bearer <key>` on its admin routes; SGLang gets it as `--admin-api-key` (which leaves
/generate and /health open, as the proxy needs).
"""

from __future__ import annotations

import os
import secrets

ADMIN_KEY_ENV = "GYRE_ENGINE_ADMIN_KEY"
_key: str | None = None


def new_admin_key() -> str:
    return secrets.token_urlsafe(32)


def take_run_admin_key() -> str:
    """This process's run key: taken out of the environment on first use (made here if absent)."""
    global _key
    if _key is None:
        _key = os.environ.pop(ADMIN_KEY_ENV, None) or new_admin_key()
    os.environ.pop(ADMIN_KEY_ENV, None)
    return _key


def set_run_admin_key(key: str) -> None:
    global _key
    _key = key
    os.environ.pop(ADMIN_KEY_ENV, None)


def admin_env() -> dict[str, str]:
    """The environment entry that gives an engine (or a job that starts engines) this run's key."""
    return {ADMIN_KEY_ENV: take_run_admin_key()}


def admin_headers(key: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key or take_run_admin_key()}"}


def bearer_matches(header: str | None, key: str) -> bool:
    """`Authorization: Bearer <key>`, compared in constant time (as SGLang's auth middleware does)."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())
