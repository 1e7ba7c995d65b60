"""SGLang rollout engines: command lines from config, server processes, and the role-switch and
weight-sync sequences, all driven through gyre.engine.client.EngineClient (the proxy's client).

    argv = sglang_launch_command(model_dir, cfg.engine, port=30000, model=cfg.model)
    engine = start_sglang_server(model_dir, cfg.engine, model=cfg.model)   # waits for /health_generate
    await release_for_training(client)                                     # rollout -> train
    await resume_for_rollout(client, lambda: sync_from_disk(client, ckpt, "3"))  # train -> rollout

The role-switch and sync functions speak SGLang's native protocol only, so they drive the embedded
engine the same way (which is how they are tested on CPU and timed on one GPU).
Flag names follow sglang/srt/arg_groups/fields/*.py (tests parse our argv with SGLang's own parser).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre.config.schema import EngineConfig, ModelConfig
from gyre.config.validate import check_engine, check_engine_for_model
from gyre.engine.admin_key import take_run_admin_key
from gyre.engine.client import EngineClient, EngineError
from gyre.engine.launcher import EngineProcess, EngineStartError, _tail

MEMORY_TAGS = ("weights", "kv_cache")


def free_port(host: str = "127.0.0.1") -> int:
    """SGLang needs a concrete port (it binds several: HTTP, NCCL, ZMQ); 0 in config means pick one here."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def sglang_server_args(
    model_path: str | Path,
    cfg: EngineConfig,
    port: int,
    model: ModelConfig | None = None,
    weight_version: str = "default",
    served_model_name: str | None = None,
) -> list[str]:
    """The `python -m sglang.launch_server` arguments for one engine of a cell."""
    check_engine(cfg)
    if cfg.backend != "sglang":
        raise ValueError(f"engine.backend={cfg.backend!r}: SGLang command lines are for engine.backend=sglang")
    if model is not None:
        check_engine_for_model(cfg, model)
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is not a TCP port; pick one with free_port()")
    argv = [
        "--model-path", str(model_path),
        "--host", cfg.host,
        "--port", str(port),
        "--tp-size", str(cfg.tp_size),
        "--mem-fraction-static", str(cfg.mem_fraction_static),
        "--max-running-requests", str(cfg.max_running_requests),
        "--context-length", str(cfg.max_context_tokens),
        "--dtype", cfg.dtype,
        "--load-format", cfg.load_format,
        "--weight-version", weight_version,
        "--random-seed", str(cfg.random_seed),
        "--base-gpu-id", str(cfg.base_gpu_id),
        "--log-level", cfg.log_level,
    ]  # fmt: skip
    # The run's key for every route but /health*: admin routes for the controller and cells only, and
    # /server_info, which lists the server args (the admin key among them), closed as well.
    key = take_run_admin_key()
    argv += ["--api-key", key, "--admin-api-key", key]
    flags = {
        "--enable-memory-saver": cfg.enable_memory_saver,
        "--enable-weights-cpu-backup": cfg.enable_weights_cpu_backup,
        "--disable-radix-cache": cfg.disable_radix_cache,
        "--enable-hierarchical-cache": cfg.enable_hierarchical_cache,
    }
    argv += [flag for flag, on in flags.items() if on]
    if cfg.chunked_prefill_size:
        argv += ["--chunked-prefill-size", str(cfg.chunked_prefill_size)]
    if cfg.hicache_storage_backend:
        argv += ["--hicache-storage-backend", cfg.hicache_storage_backend]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    return argv + list(cfg.extra_args)


def sglang_launch_command(
    model_path: str | Path, cfg: EngineConfig, port: int, model: ModelConfig | None = None, **kwargs: Any
) -> list[str]:
    return [cfg.python, "-m", "sglang.launch_server", *sglang_server_args(model_path, cfg, port, model, **kwargs)]


def wait_until_serving(engine: EngineProcess, timeout_s: float, poll_s: float = 1.0) -> EngineProcess:
    """Block until the engine answers /health_generate (it generated a token), or raise with its log."""

    async def probe() -> bool:
        client = EngineClient(engine.url, timeout_s=30.0)
        try:
            return await client.health_generate()
        finally:
            await client.close()

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not engine.alive():
            code = engine.stop()
            raise EngineStartError(
                f"engine at {engine.url} exited with code {code} before serving; log {engine.log_path}:\n"
                f"{_tail(engine.log_path)}"
            )
        if asyncio.run(probe()):
            return engine
        time.sleep(poll_s)
    engine.stop()
    raise EngineStartError(
        f"engine at {engine.url} not serving after {timeout_s:.0f}s (raise engine.startup_timeout_s for big "
        f"checkpoints); log {engine.log_path}:\n{_tail(engine.log_path)}"
    )


def start_sglang_server(
    model_path: str | Path,
    cfg: EngineConfig,
    model: ModelConfig | None = None,
    port: int | None = None,
    log_path: str | Path | None = None,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> EngineProcess:
    """Launch an SGLang server in its own process group and wait until it serves."""
    port = port or cfg.port or free_port(cfg.host)
    cmd = sglang_launch_command(model_path, cfg, port, model, **kwargs)
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="gyre-sglang-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "w")  # noqa: SIM115 - owned by the EngineProcess
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    except OSError as e:
        log_file.close()
        raise EngineStartError(f"cannot run {cmd[0]!r} ({e}); set engine.python to an interpreter with sglang") from e
    engine = EngineProcess(proc, f"http://{cfg.host}:{port}", log_path, str(model_path), log_file)
    return wait_until_serving(engine, cfg.startup_timeout_s)


# ----- role switches and weight sync (any engine speaking SGLang's protocol) -----


@dataclass
class SwitchTimings:
    """Seconds spent in each phase of one role switch."""

    pause_s: float = 0.0
    release_s: float = 0.0
    resume_weights_s: float = 0.0
    sync_s: float = 0.0
    resume_kv_s: float = 0.0
    continue_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.pause_s + self.release_s + self.resume_weights_s + self.sync_s + self.resume_kv_s + self.continue_s


async def release_for_training(client: EngineClient, pause_mode: str = "retract") -> SwitchTimings:
    """Rollout -> train: stop decoding (retract keeps requests queued; their prefixes stay in the radix
    cache until it is released), then free weights and KV cache memory for the trainer."""
    t = SwitchTimings()
    t0 = time.perf_counter()
    await client.pause_generation(pause_mode)
    t1 = time.perf_counter()
    await client.release_memory()
    t.pause_s, t.release_s = t1 - t0, time.perf_counter() - t1
    return t


async def resume_for_rollout(client: EngineClient, sync: Callable[[], Awaitable[Any]] | None = None) -> SwitchTimings:
    """Train -> rollout: weights memory first, then the new weights (sync), then the KV cache (so the
    trainer's memory is gone before the KV pool returns), then continue the retracted requests."""
    t = SwitchTimings()
    t0 = time.perf_counter()
    await client.resume_memory(["weights"])
    t1 = time.perf_counter()
    if sync is not None:
        await sync()
    t2 = time.perf_counter()
    await client.resume_memory(["kv_cache"])
    t3 = time.perf_counter()
    await client.continue_generation()
    t.resume_weights_s, t.sync_s, t.resume_kv_s, t.continue_s = t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3
    return t


async def sync_from_disk(client: EngineClient, checkpoint_dir: str | Path, version: str) -> None:
    await client.update_weights_from_disk(str(checkpoint_dir), version)
    await _check_version(client, version)


async def sync_from_tensor(client: EngineClient, state: dict[str, Any], version: str, tp_size: int = 1) -> None:
    """Same-node sync; `state` holds HF-named tensors (CUDA tensors go as IPC handles)."""
    from gyre.engine.sglang_weights import serialize_named_tensors

    await client.update_weights_from_tensor(serialize_named_tensors(state.items(), tp_size), version)
    await _check_version(client, version)


async def sync_from_distributed(client: EngineClient, state: dict[str, Any], version: str, group: Any) -> None:
    """Broadcast `state` from trainer rank 0 of `group` (see sglang_weights.open_weight_update_group)
    while the engine receives it; both sides follow the announced name order."""
    from gyre.engine.sglang_weights import broadcast_state, distributed_metadata

    names, dtypes, shapes = distributed_metadata(state)
    request = client.update_weights_from_distributed(names, dtypes, shapes, version)
    await asyncio.gather(request, asyncio.to_thread(broadcast_state, state, group))
    await _check_version(client, version)


async def _check_version(client: EngineClient, version: str) -> None:
    info = await client.server_info()
    got = info.get("weight_version") or (info.get("internal_states") or [{}])[0].get("weight_version")
    if got is not None and str(got) != version:
        raise EngineError(f"engine at {client.base_url} reports weight_version {got!r} after syncing {version!r}")
