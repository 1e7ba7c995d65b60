"""SGLang's hierarchical cache over a Mooncake store shared by a run's engines (engine.hicache_storage_backend=
mooncake): the store's master, which the controller starts on its node when the engines' extra config names
none, and the clearing of the store once per weight version.

    master = start_master("10.0.0.1", log_dir / "mooncake_master.log")   # dies with this process
    cfg.engine = with_master(cfg.engine, master.address)                  # into --hicache-storage-backend-extra-config
    ... every engine took version v ...
    clear_store(engine_urls)                                              # before v's KV is worth keeping

The store's keys are hashes of token pages (sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py),
with no weight version in them: KV an engine computed under version v-1 would be loaded by an engine serving
v. So after every engine took v the store is emptied (SGLang's POST /hicache/storage-backend/clear:
`store.remove_all()`, and the engine's own record of what the store holds) on every engine. What this leaves
open is stated in docs/gpu.md.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gyre.config.schema import EngineConfig
from gyre.engine.client import SyncEngineClient
from gyre.lifetime import spawn_tied

MOONCAKE = "mooncake"
MASTER_KEYS = ("master_server_address", "client_server_address")  # MooncakeStoreConfig.load_from_extra_config


def needs_master(cfg: EngineConfig) -> bool:
    """Whether the run starts the store's master: a Mooncake store is asked for and its config names none."""
    if cfg.backend != "sglang" or cfg.hicache_storage_backend != MOONCAKE:
        return False
    extra = json.loads(cfg.hicache_storage_extra_config or "{}")
    return not any(extra.get(k) for k in MASTER_KEYS)


def with_master(cfg: EngineConfig, address: str) -> EngineConfig:
    """The engine config with the master's host:port in its extra config (what the site set kept)."""
    extra = json.loads(cfg.hicache_storage_extra_config or "{}")
    extra.setdefault("master_server_address", address)
    return dataclasses.replace(cfg, hicache_storage_extra_config=json.dumps(extra, sort_keys=True))


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def master_command(host: str, rpc_port: int, metrics_port: int) -> list[str]:
    """mooncake_master (the mooncake-transfer-engine wheel's binary, run by its console entry point's module)
    serving its RPC and its metrics on `host` only."""
    return [sys.executable, "-m", "mooncake.cli", f"--rpc_address={host}", f"--rpc_port={rpc_port}",
            f"--metrics_host={host}", f"--metrics_port={metrics_port}"]  # fmt: skip


@dataclass
class MooncakeMaster:
    process: subprocess.Popen
    address: str  # host:port, the engines' master_server_address
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_master(host: str, log_path: Path, timeout_s: float = 60.0) -> MooncakeMaster:
    """Start mooncake_master on `host` (this node's address), tied to this process (gyre.lifetime), and wait
    until it accepts connections; raise with its log if it does not."""
    rpc, metrics = _free_port(host), _free_port(host)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = spawn_tied(master_command(host, rpc, metrics), stdout=log, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    master = MooncakeMaster(proc, f"{host}:{rpc}", log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and master.alive():
        try:
            socket.create_connection((host, rpc), timeout=1.0).close()
            return master
        except OSError:
            time.sleep(0.2)
    master.stop()
    raise RuntimeError(f"mooncake_master at {master.address} did not start; log {log_path}:\n"
                       f"{log_path.read_text()[-2000:]}")  # fmt: skip


def clear_store(urls: list[str]) -> None:
    """Empty the shared store through every engine (each also forgets what it believed the store held)."""
    for url in urls:
        SyncEngineClient(url).clear_hicache_storage()
