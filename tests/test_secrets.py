"""The engine admin key is in no process's environment or command line: the embedded engine reads it from a
pipe, SGLang from a 0600 file of its --config (gyre.engine.admin_key). Read where any process of the same
user would look: /proc/<pid>/environ (the block a process started with, which os.environ.pop does not
change) and /proc/<pid>/cmdline."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp
import pytest

from gyre.config.schema import EngineConfig
from gyre.engine.admin_key import ADMIN_KEY_ENV, admin_headers, take_run_admin_key
from gyre.engine.launcher import start_engine
from gyre.engine.sglang_backend import sglang_launch_command
from gyre.model.random_model import SHAPES, create_random_model


def proc_file(pid: int, name: str) -> bytes:
    return Path(f"/proc/{pid}/{name}").read_bytes()


async def status_of(url: str, path: str, headers: dict[str, str]) -> int:
    async with aiohttp.ClientSession() as s, s.post(url + path, json={}, headers=headers) as r:
        return r.status


@pytest.mark.integration
def test_the_embedded_engines_admin_key_is_in_no_environment_or_command_line(tmp_path):
    key = take_run_admin_key().encode()
    model = create_random_model(tmp_path / "model", SHAPES["qwen3-tiny"], seed=0)
    engine = start_engine(model, num_threads=1, max_context_tokens=256, startup_timeout_s=120)
    try:
        for pid in (engine.pid, os.getpid()):  # the engine, and the trainer that started it
            assert key not in proc_file(pid, "environ"), pid
            assert key not in proc_file(pid, "cmdline"), pid
            assert ADMIN_KEY_ENV.encode() not in proc_file(pid, "environ"), pid
        assert b"--admin-key-fd=" in proc_file(engine.pid, "cmdline")
        fds = {os.readlink(f"/proc/{engine.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{engine.pid}/fd")}
        assert not any(link.startswith("pipe:") for link in fds), fds  # the key's pipe: read, then closed
        # the key still guards the admin routes: refused without it, accepted with it
        assert asyncio.run(status_of(engine.url, "/flush_cache", {})) == 401
        assert asyncio.run(status_of(engine.url, "/flush_cache", {"Authorization": "Bearer guessed"})) == 401
        assert asyncio.run(status_of(engine.url, "/flush_cache", admin_headers())) == 200
    finally:
        engine.stop()


@pytest.mark.unit
def test_sglang_gets_the_key_from_a_file_only_its_user_reads(tmp_path):
    key = take_run_admin_key()
    cmd = sglang_launch_command("/m", EngineConfig(backend="sglang"), 30000)
    assert key not in " ".join(cmd)
    config = Path(cmd[cmd.index("--config") + 1])
    assert config.stat().st_mode & 0o777 == 0o600 and config.stat().st_uid == os.getuid()
    assert f'admin-api-key: "{key}"' in config.read_text() and f'api-key: "{key}"' in config.read_text()
    assert (config.parent.stat().st_mode & 0o077) == 0  # its private directory: no one else even lists it


@pytest.mark.unit
def test_an_engine_admin_key_never_reads_as_a_flag():
    """SGLang gets the key as `--api-key KEY` (from its --config file): a key starting with '-' stopped its argument
    parser (urlsafe base64 keys did, one in 64)."""
    from gyre.engine.admin_key import new_admin_key

    assert not any(new_admin_key().startswith("-") for _ in range(2000))
