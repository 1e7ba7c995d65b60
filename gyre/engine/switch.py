"""The role switch of a rollout engine, written once for every backend and every caller (the colocate
loop, the cell runtime, tools/gpu_check.py):

    rollout -> train:  pause generation, release memory (weights and KV cache)
    ... the trainer uses the memory ...
    train -> rollout:  resume the weights' memory, update the weights (with their version),
                       resume the KV cache's memory, continue generation

The KV cache comes back only after the new weights are in, so the trainer's memory is gone before the
KV pool returns. Pause mode "abort" hands stragglers back to the proxy (which continues them elsewhere);
"retract" keeps them queued on this engine, to finish after the switch. New weights into an engine that
stays in rollout go through `update_while_serving`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Switchable(Protocol):
    def pause(self, mode: str) -> None: ...
    def continue_generation(self) -> None: ...
    def release_memory(self, tags: list[str] | None = None) -> None: ...
    def resume_memory(self, tags: list[str] | None = None) -> None: ...


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


def leave_rollout(engine: Switchable, pause_mode: str = "abort") -> SwitchTimings:
    """Rollout -> train: stop generating, then free the engine's memory for the trainer."""
    t = SwitchTimings()
    t0 = time.perf_counter()
    engine.pause(pause_mode)
    t1 = time.perf_counter()
    engine.release_memory()
    t.pause_s, t.release_s = t1 - t0, time.perf_counter() - t1
    return t


def join_rollout(engine: Switchable, update_weights: Callable[[], None] | None = None) -> SwitchTimings:
    """Train -> rollout: weights' memory, the new weights (update_weights; None: keep the current ones),
    the KV cache's memory, then generation continues."""
    t = SwitchTimings()
    t0 = time.perf_counter()
    engine.resume_memory(["weights"])
    t1 = time.perf_counter()
    if update_weights is not None:
        update_weights()
    t2 = time.perf_counter()
    engine.resume_memory(["kv_cache"])
    t3 = time.perf_counter()
    engine.continue_generation()
    t.resume_weights_s, t.sync_s, t.resume_kv_s, t.continue_s = t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3
    return t


def update_while_serving(engine: Switchable, update: Callable[[], None]) -> None:
    """New weights into an engine that keeps serving. SGLang (0.5.23) flushes its cache at every update and
    its scheduler flushes only when idle, failing the update otherwise (flush_cache_after_weight_update): its
    running requests are retracted first (re-queued; their KV recomputed under the new weights when generation
    continues). The embedded engine updates under running requests, which continue with the new weights."""
    if getattr(engine, "backend", "") != "sglang":
        update()
        return
    engine.pause("retract")
    try:
        update()
    finally:
        engine.continue_generation()
