"""A cell's rollout engine: whichever backend engine.backend names (gyre.engine.engine.make_engine),
switched between roles by gyre.engine.switch, restarted when it died.

An engine dies with the process of its cell, even a SIGKILLed one (gyre.lifetime.spawn_tied), from
whichever thread the cell starts it.

Leaving rollout pauses (aborting stragglers back to the proxy) and releases memory; returning resumes
memory, loads the newest weights if the engine is behind (engine.weight_sync: the embedded engine from a
checkpoint the cell writes, in /dev/shm when there is one; SGLang by broadcast from the trainer) and
continues generation. A dead engine is started again on return to rollout, from the newest weights.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from gyre.config.schema import EngineConfig
from gyre.engine.engine import EngineSetup, RolloutEngine, make_engine
from gyre.engine.switch import join_rollout, leave_rollout, update_while_serving
from gyre.lifetime import pid_alive

if TYPE_CHECKING:  # torch loads in the cell while its engine starts
    import torch


SCRATCH_PREFIX = "gyre-cell-weights-"  # then the cell's pid, "-", tempfile's random letters


def cell_scratch() -> Path:
    """A fresh directory for the weights a cell's engine restarts from, in memory (/dev/shm) where there is one,
    named after this process. A cell removes its own when it stops; one that was killed cannot, and a model's
    weights would hold the node's memory: those of this user's cells whose process is gone go first."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() else Path(tempfile.gettempdir())
    remove_orphaned_scratch(base)
    return Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=base))


def remove_orphaned_scratch(base: Path) -> list[Path]:
    """Remove the scratch directories in `base` that this user's cells left when they died (their pid no longer
    runs); returns them. Another user's, and a living process's, stay. A node's cells share one pid namespace (as
    under Slurm): a cell in a container with its own, sharing this /dev/shm, would look dead from here."""
    removed = []
    for path in base.glob(f"{SCRATCH_PREFIX}*-*"):
        pid = path.name[len(SCRATCH_PREFIX) :].split("-", 1)[0]
        try:
            mine = path.is_dir() and not path.is_symlink() and path.stat().st_uid == os.getuid()
        except OSError:  # removed meanwhile
            continue
        if mine and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class CellEngine:
    def __init__(
        self,
        cfg: EngineConfig,
        setup: EngineSetup,
        checkpoint_dir: Path,
        kv_transfer: bool = True,
        keep_scratch: bool = False,
    ) -> None:
        """`checkpoint_dir`: the weights it starts from before the cell writes any (setup.scratch: removed at stop
        unless `keep_scratch`, the run's RUN_DIR/weights). `kv_transfer`: False for the run's only engine, whose
        keys/values never move."""
        self.cfg = cfg
        self.checkpoint_dir = checkpoint_dir
        self.owns_scratch = not keep_scratch
        self.scratch = setup.scratch
        self.engine: RolloutEngine = make_engine(self.cfg, setup)
        self.setup = setup
        self.kv_transfer = kv_transfer
        self.starts = 0
        self.start()

    @property
    def version(self) -> str:
        return self.engine.version

    @property
    def url(self) -> str:
        return self.engine.urls[0] if self.engine.urls else ""

    @property
    def urls(self) -> list[str]:
        return self.engine.urls

    @property
    def pid(self) -> int:
        return self.engine.pid

    def alive(self) -> bool:
        return self.engine.alive()

    def start(self) -> None:
        """Serve the newest weights this cell has written (the warm start before any)."""
        weights = self.scratch / "current" if (self.scratch / "current").exists() else self.checkpoint_dir
        self.starts += 1
        self.engine.start(weights)
        if (
            self.engine.backend == "embedded" and self.kv_transfer
        ):  # starts its Mooncake transfer engine now, not mid-switch
            from gyre.engine.client import SyncEngineClient

            SyncEngineClient(self.url).post("/gyre/kv/release")

    def leave_rollout(self) -> None:
        leave_rollout(self.engine, pause_mode="abort")  # stragglers go back to the proxy

    def join_rollout(self, state: dict[str, torch.Tensor] | None, version: str) -> None:
        if not self.alive():
            self.engine.stop()
            if state is not None:
                self._write(state, version)
            self.start()
            return
        stale = state is not None and version != self.version
        join_rollout(self.engine, (lambda: self.engine.update_weights(state, version)) if stale else None)

    def resume(self, update: Callable[[], None] | None) -> None:
        """Back to rollout, alive, loading new weights by `update` (None: keep the ones it serves)."""
        join_rollout(self.engine, update)

    def load_while_serving(self, update: Callable[[], None]) -> None:
        """New weights by `update` while the engine stays in rollout (gyre.engine.switch.update_while_serving)."""
        update_while_serving(self.engine, update)

    def load(self, state: dict[str, torch.Tensor], version: str) -> None:
        """New weights while serving: running requests continue with them (SGLang's weight_versions record it)."""
        self.engine.update_weights(state, version)

    def _write(self, state: dict[str, torch.Tensor], version: str) -> None:
        """The checkpoint a restarted engine starts from."""
        from gyre.model.hf_io import save_hf_checkpoint

        save_hf_checkpoint(self.scratch / "current", state, self.setup.model_cfg, self.setup.tokenizer_dir)
        self.engine.version = version

    def stop(self) -> None:
        self.engine.stop()
        if self.owns_scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)


def cell_env(hostname: str, protocol: str, threads: int) -> dict[str, str]:
    """What a cell's engine needs in its environment: Mooncake's address and thread counts."""
    return {
        "GYRE_KV_HOSTNAME": hostname,
        "GYRE_KV_PROTOCOL": protocol,
        "OMP_NUM_THREADS": str(threads),
        "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR"),
    }


def cell_nodes(cell: int, env: Mapping[str, str]) -> list[str]:
    """The hosts of a cell's het component under Slurm, this host first; outside Slurm, [] (this host)."""
    nodelist = env.get(f"SLURM_JOB_NODELIST_HET_GROUP_{cell}") or env.get("SLURM_JOB_NODELIST", "")
    if not nodelist:
        return []
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    hosts = out.stdout.split()
    here = env.get("SLURMD_NODENAME") or socket.gethostname()
    return [here, *(h for h in hosts if h != here)] if here in hosts else hosts
