"""What the simulator runs: rollouts made of model calls and tool time, and cells that serve or train.

A rollout is a sequence of calls (new prompt tokens to prefill, tokens to decode), each followed by
tool time, plus a fixed overhead (harness start-up), its grading after the harness (outside its session
slot) and a hard timeout. A cell serves up to
`capacity` sessions with an engine of given prefill and decode throughput, or trains at `train_tps`
forward-backward tokens a second; switching costs seconds each way, and a step ends with a gradient
reduction and a weight sync. `Workload.sample` draws the rollouts of a step from a long-tailed model
(a per-rollout lognormal factor on tool time, `tail_sigma`, as the built-in harness draws it).
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from gyre.config.schema import Admission
from gyre.sched.policy import KEEP_TRAINING


@dataclass(frozen=True)
class Call:
    prefill: int  # prompt tokens the engine computes (not cached)
    decode: int  # tokens generated
    tool_s: float  # tool time after the call (seconds)


@dataclass(frozen=True)
class Rollout:
    rollout_id: str
    group: int
    calls: tuple[Call, ...]
    overhead_s: float = 0.0  # harness start-up: held capacity, no engine work
    train_tokens: int = 0  # tokens it adds to the step's training
    cpu_s: float = 0.0  # the harness's own CPU work (start-up) alone on a CPU: slowed by contention
    # after its harness, outside its slot (gyre.sched.controller.sessions): grading, as seconds and as CPU work
    end_s: float = 0.0
    end_cpu_s: float = 0.0


@dataclass(frozen=True)
class CellModel:
    """One cell, on either side. Engine time of a call: `call_s` + prefill at `prefill_tps` shared by the
    cell's calls in flight + decode at min(`session_tps`, `decode_tps` / calls in flight)."""

    capacity: int  # concurrent sessions one rollout cell serves (its KV budget)
    decode_tps: float  # a rollout cell's aggregate decode tokens/s
    session_tps: float  # decode tokens/s of one call alone
    prefill_tps: float  # a rollout cell's prefill tokens/s
    call_s: float  # fixed engine + proxy time per call
    train_tps: float  # forward-backward tokens/s of one training cell
    micro_batch_s: float  # fixed time per micro-batch
    to_train_s: float  # rollout -> train switch (release the engine, move in-flight KV)
    to_rollout_s: float  # train -> rollout switch (resume the engine at the newest weights)
    reduce_s: float  # gradient reduction and optimizer step at the end of a step
    sync_s: float  # weight sync to every cell after it
    kv_migration_s: float = 0.0  # added to a rollout->train switch per session it moves
    group_write_s: float = 0.0  # time to write a completed group's shard and plan it
    group_write_blocks: bool = True  # written by the controller's loop (runs before the writer thread)
    first_micro_batch_s: float = 0.0  # extra time of a cell's first micro-batch after it began training
    # CPUs the harnesses, engines and trainers share (one machine, a local benchmark): each CPU job (a session's
    # own CPU work, an engine with calls in flight, a training cell's micro-batch) runs at cpus / jobs of a CPU
    # when jobs outnumber them. inf: each has its own (a cluster, where a cell owns its GPUs)
    cpus: float = math.inf

    def slowdown(self, cpu_jobs: float) -> float:
        """How much longer CPU work takes with `cpu_jobs` jobs (itself included) on the shared CPUs."""
        return max(1.0, cpu_jobs / self.cpus)

    def call_seconds(self, call: Call, in_flight: float) -> float:
        """Engine time of `call` started with `in_flight` calls (itself included) on its cell."""
        n = max(1.0, in_flight)
        decode_rate = min(self.session_tps, self.decode_tps / n)
        return self.call_s + call.prefill * n / self.prefill_tps + call.decode / decode_rate

    def micro_batch_seconds(self, tokens: int) -> float:
        return self.micro_batch_s + tokens / self.train_tps


@dataclass(frozen=True)
class RunShape:
    """The RL run around the workload."""

    steps: int
    groups_per_step: int
    group_size: int
    n_cells: int
    staleness: int = 1
    micro_batch_tokens: int = 4096
    micro_batches_in_flight: int = 1
    timeout_s: float = math.inf  # a session still running after this long is ended (and scored as is)
    async_rollout_cells: int = 0
    keep_training: int = KEEP_TRAINING  # elastic's policy: see gyre.sched.policy.PolicyConfig
    admission: str = Admission.group_length  # which queued session starts next: gyre.sched.policy.admission


@dataclass(frozen=True)
class Workload:
    """A parametric rollout model: calls per rollout, tokens per call, tool time, a long tail."""

    calls_mean: float  # calls per rollout (geometric-ish around the mean, at least 1)
    prefill_per_call: int
    decode_per_call: int
    tool_s: float  # mean tool time after a call
    tail_sigma: float  # per-rollout lognormal factor (mean 1) on tool time: the long tail
    overhead_s: float = 0.0
    train_tokens_per_rollout: int = 0  # 0: every prefilled and decoded token
    calls_sigma: float = 0.3  # per-rollout lognormal spread of the number of calls
    max_calls_per_segment: int = 1  # merge consecutive calls (faster simulation of hundreds of calls)
    seed: int = 0

    def sample(self, step: int, shape: RunShape) -> list[Rollout]:
        return _sample(self, step, shape.groups_per_step, shape.group_size)

    def rollout(self, rid: str, group: int) -> Rollout:
        rng = random.Random(f"{self.seed}:{rid}")
        factor = tool_factor(f"{self.seed}:{rid}", self.tail_sigma)
        n = max(1, round(self.calls_mean * rng.lognormvariate(-(self.calls_sigma**2) / 2, self.calls_sigma)))
        k = max(1, self.max_calls_per_segment)  # consecutive calls merged into one segment
        sizes = [k] * (n // k) + ([n % k] if n % k else [])
        calls = tuple(
            Call(self.prefill_per_call * m, self.decode_per_call * m, self.tool_s * factor * m) for m in sizes
        )
        tokens = self.train_tokens_per_rollout or n * (self.prefill_per_call + self.decode_per_call)
        return Rollout(rid, group, calls, self.overhead_s, tokens)


@functools.lru_cache(maxsize=256)
def _sample(w: Workload, step: int, groups: int, group_size: int) -> list[Rollout]:
    return [w.rollout(f"s{step}-g{g}-r{i}", g) for g in range(groups) for i in range(group_size)]


def tool_factor(key: str, sigma: float) -> float:
    """Lognormal with mean 1, seeded by `key` (gyre.harness.builtin.rollout_tool_factor draws it alike)."""
    return random.Random(key).lognormvariate(-sigma * sigma / 2, sigma) if sigma > 0 else 1.0


@dataclass
class Trace:
    """Rollouts given one by one (a calibrated replay of measured rollouts), by step."""

    by_step: dict[int, list[Rollout]] = field(default_factory=dict)
    fallback: Callable[[int], list[Rollout]] | None = None

    def sample(self, step: int, shape: RunShape) -> list[Rollout]:
        if step in self.by_step:
            return self.by_step[step]
        if self.fallback is None:
            raise KeyError(f"the trace has no rollouts for step {step}")
        return self.fallback(step)
