"""A lower bound on the wall time of any scheduler, for a workload, cells and staleness bound.

Three bounds; the largest holds.
- chain: rollouts of step s cannot start before version s - staleness exists (step s - staleness - 1
  trained); the step cannot be trained before its slowest rollout ends (each rollout at its own speed,
  alone on an engine) and is graded, its last group's shard is written and its largest micro-batch trained; steps
  train one after the other, each at best on every cell at once; each ends with a reduction and a
  weight sync.
- work: every cell-second goes to rollouts (a session holds 1/capacity of a cell while its harness
  runs) or to training micro-batches, so the total divided by the number of cells.
- cpu: on CPUs the engines, trainers and harnesses share (`CellModel.cpus`, one machine), the CPU work
  alone (the sessions' own work and grading, each engine's calls, at best `capacity` of them at once, and
  the micro-batches) divided by the CPUs: however it is scheduled, the CPUs do no more than that a second.

gyre.sim.predict.run_bound gives a run's bound on its own workload (its sessions' tokens and tool sleeps)
at costs fitted from other runs, the same costs for every scheduler: a bound computed from a run's own
records moves with the run (a scheduler that slows its sessions raises its own bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gyre.sim.simulator import RolloutSource
from gyre.sim.workload import CellModel, Rollout, RunShape


@dataclass(frozen=True)
class Bound:
    chain_s: float
    work_s: float
    cpu_s: float = 0.0

    @property
    def seconds(self) -> float:
        return max(self.chain_s, self.work_s, self.cpu_s)


def alone_seconds(r: Rollout, cell: CellModel, timeout_s: float) -> float:
    """The rollout's slot-seconds alone: its harness from start-up to its end (or its timeout)."""
    s = r.overhead_s + r.cpu_s + sum(cell.call_seconds(c, 1.0) + c.tool_s for c in r.calls)
    return min(s, timeout_s)


def graded_seconds(r: Rollout) -> float:
    """Its grading after the harness, alone on a CPU (outside its slot)."""
    return r.end_s + r.end_cpu_s


def lower_bound(cell: CellModel, shape: RunShape, source: RolloutSource) -> Bound:
    n = shape.n_cells
    ends: list[float] = []
    work = cpu = 0.0
    for step in range(shape.steps):
        rollouts = source.sample(step, shape)
        durations = [alone_seconds(r, cell, shape.timeout_s) for r in rollouts]
        graded = [d + graded_seconds(r) for d, r in zip(durations, rollouts, strict=True)]
        tokens = sum(r.train_tokens for r in rollouts)
        n_mb = sum(math.ceil(g / shape.micro_batch_tokens) for g in _group_tokens(rollouts).values())
        train_cell_s = n_mb * cell.micro_batch_s + tokens / cell.train_tps
        last_mb = cell.micro_batch_seconds(min(shape.micro_batch_tokens, max(_group_tokens(rollouts).values())))
        start = ends[step - shape.staleness - 1] if step - shape.staleness - 1 >= 0 else 0.0
        rollouts_end = start + max(graded)
        prev = ends[-1] if ends else 0.0
        trained = max(rollouts_end + cell.group_write_s + last_mb, prev + train_cell_s / n)
        ends.append(trained + cell.reduce_s + cell.sync_s)
        work += sum(durations) / cell.capacity + train_cell_s
        calls = sum(cell.call_seconds(c, 1.0) for r in rollouts for c in r.calls)
        cpu += sum(r.cpu_s + r.end_cpu_s for r in rollouts) + calls / cell.capacity + train_cell_s
    return Bound(ends[-1], work / n, cpu / cell.cpus)


def _group_tokens(rollouts: list[Rollout]) -> dict[int, int]:
    out: dict[int, int] = {}
    for r in rollouts:
        out[r.group] = out.get(r.group, 0) + r.train_tokens
    return out
