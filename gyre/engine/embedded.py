"""The embedded engine behind the RolloutEngine interface: one gyre.engine.server subprocess.

Start it from the main thread: the launcher ties the engine's life to the thread that started it
(PR_SET_PDEATHSIG), so that an engine dies with its cell even when the cell is SIGKILLed. New weights
arrive from disk (a checkpoint written to the scratch directory, /dev/shm in a cell); its KV export and
import routes (/gyre/kv/*) move in-flight requests between embedded engines through Mooncake.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre.config.schema import EngineConfig
from gyre.engine.engine import EngineServers, EngineSetup, EngineUnsupported
from gyre.engine.launcher import EngineProcess, start_engine_from_config

if TYPE_CHECKING:
    import torch


class EmbeddedEngine:
    backend = "embedded"

    def __init__(self, cfg: EngineConfig, setup: EngineSetup) -> None:
        self.cfg, self.setup = cfg, setup
        self.version = "0"
        self.starts = 0
        self.process: EngineProcess | None = None
        self.servers = EngineServers([])

    @property
    def urls(self) -> list[str]:
        return self.servers.urls

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else -1

    def start(self, weights: Path) -> None:
        self.starts += 1
        name = "engine.log" if self.starts == 1 else f"engine{self.starts}.log"
        self.process = start_engine_from_config(
            weights,
            self.cfg,
            log_path=self.setup.log_dir / name,
            weight_version=self.version,
            env=self.setup.env,
            weights_dirs=[self.setup.scratch],  # where write_weights puts new weights; a path elsewhere is refused
        )
        self.servers = EngineServers([self.process.url])

    def alive(self) -> bool:
        """Its process runs and answers /health (a SIGKILLed engine can look running for a moment)."""
        return self.process is not None and self.process.alive() and self.servers.healthy()

    def log_tail(self, lines: int = 40) -> str:
        return self.process.log_tail(lines) if self.process is not None else "(not started)"

    def pause(self, mode: str) -> None:
        self.servers.pause(mode)

    def continue_generation(self) -> None:
        self.servers.continue_generation()

    def release_memory(self, tags: list[str] | None = None) -> None:
        self.servers.release_memory(tags)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self.servers.resume_memory(tags)

    def flush_cache(self) -> None:
        self.servers.flush_cache()

    def write_weights(self, state: dict[str, torch.Tensor], version: str) -> Path:
        """The checkpoint the next disk update (or restart) loads; the engine then serves `version`."""
        from gyre.model.hf_io import save_hf_checkpoint

        path = save_hf_checkpoint(self.setup.scratch / "current", state, self.setup.model_cfg, self.setup.tokenizer_dir)
        self.version = version
        return path

    def update_weights(self, state: dict[str, torch.Tensor], version: str) -> None:
        self.update_weights_from_disk(self.write_weights(state, version), version)

    def update_weights_from_disk(self, path: Path, version: str) -> None:
        self.servers.update_weights_from_disk(path, version)
        self.version = version

    def update_weights_from_tensor(self, state: dict[str, torch.Tensor], version: str) -> None:
        raise EngineUnsupported("the embedded engine loads weights from disk only (engine.weight_sync=disk)")

    def update_weights_from_distributed(self, state: dict[str, torch.Tensor], version: str) -> None:
        raise EngineUnsupported("the embedded engine loads weights from disk only (engine.weight_sync=disk)")

    def export_kv(self, prefixes: list[dict[str, Any]]) -> dict[str, Any]:
        return self.servers.clients[0].post("/gyre/kv/export", {"prefixes": prefixes})

    def import_kv(self, sessions: list[dict[str, Any]]) -> dict[str, Any]:
        return self.servers.clients[0].post("/gyre/kv/import", {"sessions": sessions})

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
