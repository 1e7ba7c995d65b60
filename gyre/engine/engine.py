"""A cell's rollout engine behind one interface, whichever backend serves it (`engine.backend`).

    engine = make_engine(cfg.engine, EngineSetup(model_cfg, tokenizer_dir, log_dir, scratch))
    engine.start(weights_dir)            # raises EngineStartError with the log's tail
    proxy routes to engine.urls          # one URL per server (SGLang: one per tensor-parallel group)
    leave_rollout(engine) / join_rollout(engine, update)   # gyre.engine.switch: the role switch, once
    engine.stop()

Both backends speak SGLang's HTTP protocol, so their control calls are the same (`EngineServers` fans
each one out to every server); they differ in how servers start and how new weights arrive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gyre.config.schema import EngineConfig, ModelConfig
from gyre.engine.client import EngineError, SyncEngineClient

if TYPE_CHECKING:
    import torch

    from gyre.engine.launcher import EngineProcess


class EngineUnsupported(EngineError):
    """The backend has no such operation (e.g. KV export on SGLang); the message says what to use instead."""


class RolloutEngine(Protocol):
    """What the colocate loop and the cell runtime need of a rollout engine."""

    backend: str
    version: str  # the weight version it serves

    @property
    def urls(self) -> list[str]: ...  # where the proxy routes requests

    @property
    def pid(self) -> int: ...

    def start(self, weights: Path) -> None: ...
    def alive(self) -> bool: ...  # every server's process runs and answers /health
    def log_tail(self, lines: int = 40) -> str: ...
    def pause(self, mode: str) -> None: ...
    def continue_generation(self) -> None: ...
    def release_memory(self, tags: list[str] | None = None) -> None: ...
    def resume_memory(self, tags: list[str] | None = None) -> None: ...
    def flush_cache(self) -> None: ...
    def update_weights(self, state: dict[str, torch.Tensor], version: str) -> None: ...  # engine.weight_sync's way
    def update_weights_from_disk(self, path: Path, version: str) -> None: ...
    def update_weights_from_tensor(self, state: dict[str, torch.Tensor], version: str) -> None: ...
    def update_weights_from_distributed(self, state: dict[str, torch.Tensor], version: str) -> None: ...
    def export_kv(self, prefixes: list[dict[str, Any]]) -> dict[str, Any]: ...
    def import_kv(self, sessions: list[dict[str, Any]]) -> dict[str, Any]: ...
    def stop(self) -> None: ...


@dataclass
class EngineSetup:
    """What an engine needs beyond its config: the model (checkpoints it writes), where logs and weight
    checkpoints go, its environment, and (SGLang) the nodes and GPUs of its cell."""

    model_cfg: ModelConfig
    tokenizer_dir: Path | None
    log_dir: Path
    scratch: Path  # new weights are written here before a disk update
    env: dict[str, str] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)  # the cell's hosts, this one first; empty: this host only
    gpus_per_node: int = 0
    trainer_address: str = "127.0.0.1"  # where the engines reach the trainer's weight-broadcast group
    routed_experts: bool = False  # rl.routing_replay: SGLang is started able to return routed experts


class EngineServers:
    """The control calls of SGLang's protocol, sent to every server of an engine, in order."""

    def __init__(self, urls: Sequence[str], timeout_s: float = 600.0) -> None:
        self.clients = [SyncEngineClient(u, timeout_s) for u in urls]

    @property
    def urls(self) -> list[str]:
        return [c.base_url for c in self.clients]

    def healthy(self, timeout_s: float = 5.0) -> bool:
        """Every server answers /health within timeout_s (a hung or SIGKILLed one must not stall the caller)."""
        return bool(self.clients) and all(SyncEngineClient(u, timeout_s).health() for u in self.urls)

    def pause(self, mode: str) -> None:
        for c in self.clients:
            c.pause_generation(mode)

    def continue_generation(self) -> None:
        for c in self.clients:
            c.continue_generation()

    def release_memory(self, tags: list[str] | None = None) -> None:
        for c in self.clients:
            c.release_memory(tags)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        for c in self.clients:
            c.resume_memory(tags)

    def flush_cache(self) -> None:
        for c in self.clients:
            c.flush_cache()

    def update_weights_from_disk(self, path: Path, version: str) -> None:
        for c in self.clients:
            c.update_weights_from_disk(str(path), version)
        self.check_version(version)

    def check_version(self, version: str) -> None:
        for c in self.clients:
            info = c.server_info()
            got = info.get("weight_version") or (info.get("internal_states") or [{}])[0].get("weight_version")
            if got is not None and str(got) != version:
                raise EngineError(f"engine at {c.base_url} reports weight_version {got!r} after syncing {version!r}")


def stop_processes(processes: Sequence[EngineProcess]) -> None:
    for p in processes:
        p.stop()


def make_engine(cfg: EngineConfig, setup: EngineSetup) -> RolloutEngine:
    """The engine `engine.backend` names (not started: call `.start(weights)`)."""
    if cfg.backend == "embedded":
        from gyre.engine.embedded import EmbeddedEngine

        return EmbeddedEngine(cfg, setup)
    if cfg.backend == "sglang":
        from gyre.engine.sglang_backend import SGLangEngine

        return SGLangEngine(cfg, setup)
    raise ValueError(f"engine.backend={cfg.backend!r}: no such backend (embedded, sglang)")
