"""A cell's rollout engine: the embedded engine subprocess, driven only through its HTTP API.

Start it from the main thread: the launcher ties the engine's life to the thread that started it
(PR_SET_PDEATHSIG), so that an engine dies with its cell even when the cell is SIGKILLed.

Roles map onto SGLang's calls: leaving rollout pauses (aborting stragglers back to the proxy) and
releases memory; returning resumes memory, loads the newest weights if the engine is behind
(`/update_weights_from_disk` from a checkpoint the cell writes, in /dev/shm when there is one) and
continues generation. A dead engine is started again on return to rollout.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from gyre.config.schema import EngineConfig, ModelConfig
from gyre.engine.launcher import EngineProcess, start_engine_from_config
from gyre.sched.reroute import engine_post

if TYPE_CHECKING:  # torch loads in the cell while its engine starts
    import torch


class CellEngine:
    def __init__(
        self,
        cfg: EngineConfig,
        model_cfg: ModelConfig,
        checkpoint_dir: Path,
        tokenizer_dir: Path,
        log_dir: Path,
        threads: int,
        env: dict[str, str],
    ) -> None:
        self.cfg = dataclasses.replace(cfg, num_threads=threads)
        self.model_cfg = model_cfg
        self.checkpoint_dir = checkpoint_dir
        self.tokenizer_dir = tokenizer_dir
        self.log_dir = log_dir
        self.env = env
        shm = Path("/dev/shm")
        self.scratch = Path(tempfile.mkdtemp(prefix="gyre-cell-weights-", dir=shm if shm.is_dir() else None))
        self.version = "0"
        self.starts = 0
        self.process: EngineProcess | None = None
        self.start()

    @property
    def url(self) -> str:
        return self.process.url if self.process is not None else ""

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else -1

    def alive(self) -> bool:
        """Its process runs and answers /health (a SIGKILLed engine can look running for a moment)."""
        if self.process is None or not self.process.alive():
            return False
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5.0) as resp:
                return resp.status == 200
        except OSError:
            return False

    def start(self) -> None:
        """Serve the newest weights this cell has written (the warm start before any)."""
        weights = self.scratch / "current" if (self.scratch / "current").exists() else self.checkpoint_dir
        self.starts += 1
        self.process = start_engine_from_config(
            weights,
            self.cfg,
            log_path=self.log_dir / f"engine{self.starts}.log",
            weight_version=self.version,
            env=self.env,
            weights_dirs=[self.scratch],  # where `load` writes; a weight path elsewhere is refused
        )
        engine_post(self.url, "/gyre/kv/release")  # starts its Mooncake transfer engine now, not mid-switch

    def leave_rollout(self) -> None:
        engine_post(self.url, "/pause_generation", {"mode": "abort"})  # stragglers go back to the proxy
        engine_post(self.url, "/release_memory_occupation")

    def join_rollout(self, state: dict[str, torch.Tensor] | None, version: str) -> None:
        if not self.alive():
            if self.process is not None:
                self.process.stop()
            if state is not None:
                self._write(state, version)
            self.start()
            return
        engine_post(self.url, "/resume_memory_occupation")
        if state is not None and version != self.version:
            self.load(state, version)
        engine_post(self.url, "/continue_generation")

    def load(self, state: dict[str, torch.Tensor], version: str) -> None:
        """New weights while serving: running requests continue with them (SGLang's weight_versions record it)."""
        path = self._write(state, version)
        engine_post(self.url, "/update_weights_from_disk", {"model_path": str(path), "weight_version": version})

    def _write(self, state: dict[str, torch.Tensor], version: str) -> Path:
        from gyre.model.hf_io import save_hf_checkpoint

        path = save_hf_checkpoint(self.scratch / "current", state, self.model_cfg, self.tokenizer_dir)
        self.version = version
        return path

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
        shutil.rmtree(self.scratch, ignore_errors=True)


def cell_env(hostname: str, protocol: str, threads: int) -> dict[str, str]:
    """What a cell's engine needs in its environment: Mooncake's address and thread counts."""
    return {
        "GYRE_KV_HOSTNAME": hostname,
        "GYRE_KV_PROTOCOL": protocol,
        "OMP_NUM_THREADS": str(threads),
        "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR"),
    }
