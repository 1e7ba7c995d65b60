"""The run's engine admin key: what unlocks an engine's admin routes (weights, memory, pause and
continue, abort, flush, KV moves), held by the controller and the cells only, never by a harness.

Made once per run: rank 0 of the cell job makes it (`take_run_admin_key`) and broadcasts it to the
cells over MPI (`set_run_admin_key`); a single-process run makes its own. It lives in memory, never in
an environment or on a command line, where any process of the same user reads it from /proc/<pid>/environ
or cmdline (popping it from os.environ does not change /proc/<pid>/environ, the block the process started
with). The embedded engine reads it from a pipe (`key_pipe`, `--admin-key-fd`) and checks it as
`Authorization: Bearer <key>` on its admin routes; SGLang, which takes keys only as arguments, reads them
from a YAML file of its `--config` readable only by the run's user (`sglang_key_config`: `--api-key` and
`--admin-api-key`, which leave /health open). Every EngineClient sends it.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
from pathlib import Path

from gyre.fsutil import process_dir

ADMIN_KEY_ENV = "GYRE_ENGINE_ADMIN_KEY"
_key: str | None = None


def new_admin_key() -> str:
    """Hex, not urlsafe base64: one key in 64 of those starts with '-', which a command line (SGLang's --config
    turns the key into `--api-key KEY`) takes for a flag."""
    return secrets.token_hex(32)


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


def key_pipe() -> int:
    """The read end of a pipe holding this run's key (for a child's pass_fds; the caller closes it after the
    child has started). A pipe holds far more than a key, so writing never blocks."""
    read, write = os.pipe()
    os.write(write, take_run_admin_key().encode())
    os.close(write)
    return read


def read_key_fd(fd: int) -> str:
    """What `key_pipe` wrote: the key, read to the end; the descriptor is closed."""
    with os.fdopen(fd, "rb") as f:
        return f.read().decode().strip()


@functools.cache
def _private_dir() -> Path:
    return process_dir("gyre-keys-")  # mode 0700, removed as the process leaves


def sglang_key_config(directory: str | Path | None = None) -> Path:
    """A YAML file for SGLang's `--config` with this run's key as `api-key` and `admin-api-key`, mode 0600, in
    `directory` (one every node of the server reads: the cell's log directory) or a private temporary one."""
    directory = Path(directory) if directory is not None else _private_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"engine-admin-key-{os.getpid()}.yaml"
    key = take_run_admin_key()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # an older file of another mode, reused
    with os.fdopen(fd, "w") as f:
        f.write(f"api-key: {json.dumps(key)}\nadmin-api-key: {json.dumps(key)}\n")
    return path


def admin_headers(key: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key or take_run_admin_key()}"}


def bearer_matches(header: str | None, key: str) -> bool:
    """`Authorization: Bearer <key>`, compared in constant time (as SGLang's auth middleware does)."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())
