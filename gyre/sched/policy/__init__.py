"""Which role each cell should have next: colocate, async and elastic as one pure function of the load.

The controller calls `decide` after every change it sees (a session finished or queued, a micro-batch
done, a cell died) with what it knows: each cell's role, whether a training cell holds work in flight,
and the rollout level (queued + running sessions). Capacity is counted in concurrent sessions per
rollout cell (a cell's KV budget); the staleness bound decides which steps' rollouts may start.

- colocate, colocate_cells: every cell serves rollouts while any session of the step is queued or running,
  then every cell trains; weights are never older than the step (staleness 0). colocate may run one cell
  (the embedded default: in one process, gyre.sched.launch.in_process); colocate_cells is the same as an MPI job
  of one cell or more (one cell of several ranks: a trainer over a node's GPUs, conf/cluster/slurm_gpu_small.yaml).
- async: a fixed split, `rollout_cells` serving and the rest (the core first) training, rollouts one
  step (or `staleness` steps) ahead of training.
- elastic: a rollout cell is released to training as soon as the remaining rollout cells can still
  serve every active session (the core goes first: it owns the optimizer). Training work that waits
  (micro-batches of completed groups, or the step's optimizer update) also takes one cell, the core,
  when none trains: the next version gates the next step's rollouts, so it is the critical path.
  Idle training cells come back (satellites first) when sessions queue: all of them when nothing waits
  to train, else all but two (KEEP_TRAINING), so that the next step's rollouts start while the current
  step trains. When the step's update waits and the core serves while satellites train (nothing left
  for them), an idle satellite comes back to serve in the core's place, and the core leaves next.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from gyre.comm.messages import Role
from gyre.config.schema import Scheduler  # declared with the config field

SCHEDULERS = tuple(Scheduler)

# elastic: cells that keep training while sessions queue and training work waits. One cell alone would take
# twice as long over the step whose update gates the next admission; beyond two, a cell that serves the
# queued sessions costs the step a third of its rate or less (gyre.sim's map: tools/sim_schedulers.py)
KEEP_TRAINING = 2


@dataclass(frozen=True)
class PolicyConfig:
    kind: str  # one of SCHEDULERS
    n_cells: int  # cell 0 is the core
    capacity: int  # concurrent sessions one rollout cell serves
    staleness: int  # rollouts of step s may start once weights of version s - staleness exist
    rollout_cells: int = 0  # async: cells fixed to rollout (0: all but the core)
    keep_training: int = KEEP_TRAINING  # elastic: trainers that stay while training waits (n_cells: none return)

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULERS:
            raise ValueError(f"scheduler={self.kind!r}: the cell schedulers are {', '.join(SCHEDULERS)}")
        if self.n_cells < self.min_cells:
            raise ValueError(
                f"{self.kind} needs at least {self.min_cells} cells (core + satellites), got {self.n_cells}"
            )
        if self.capacity < 1:
            raise ValueError(f"sched.capacity_per_cell must be at least 1, got {self.capacity}")
        if self.keep_training < 1:
            raise ValueError(f"keep_training must be at least 1 (the core trains the update), got {self.keep_training}")
        if self.staleness < 0:
            raise ValueError(f"sched.staleness must be >= 0, got {self.staleness}")
        if self.kind == Scheduler.async_ and not 0 < self.fixed_rollout_cells < self.n_cells:
            raise ValueError(
                f"sched.async_rollout_cells={self.rollout_cells} must leave at least one rollout and one "
                f"training cell of {self.n_cells}"
            )

    @property
    def colocated(self) -> bool:
        """Every cell switches together (colocate and colocate_cells, on one cell or more)."""
        return self.kind in (Scheduler.colocate, Scheduler.colocate_cells)

    @property
    def min_cells(self) -> int:
        return 1 if self.kind in (Scheduler.colocate, Scheduler.colocate_cells) else 2

    @property
    def max_lag(self) -> int:
        """The staleness bound in force: colocate always trains on its own weights."""
        return 0 if self.colocated else self.staleness

    @property
    def fixed_rollout_cells(self) -> int:
        return self.rollout_cells or self.n_cells - 1


@dataclass(frozen=True)
class CellState:
    cell: int
    role: Role
    busy: bool = False  # training work in flight: it leaves training only once that is done
    alive: bool = True


@dataclass(frozen=True)
class Load:
    queued: int = 0  # sessions allowed to start (staleness) that wait for capacity
    running: int = 0  # sessions whose harness runs
    trainable: int = 0  # training work of the current step nobody has taken (micro-batches, or its update)
    update: bool = False  # that work is the step's update, which only the core makes

    @property
    def level(self) -> int:
        return self.queued + self.running


@dataclass(frozen=True)
class Switch:
    cell: int
    role: Role
    # surplus | training_waits | update_waits | sessions_queue | colocate
    reason: str = field(default="", compare=False)


def initial_roles(p: PolicyConfig) -> tuple[Role, ...]:
    """async: satellites 1..rollout_cells serve, the core and the remaining satellites train; else all serve."""
    if p.kind != Scheduler.async_:
        return ("rollout",) * p.n_cells
    serving = set(range(1, p.fixed_rollout_cells + 1))
    return tuple("rollout" if c in serving else "train" for c in range(p.n_cells))


def may_start(p: PolicyConfig, step: int, version: int) -> bool:
    """Rollouts of `step` may start with the weights of `version` (= optimizer steps done)."""
    return step - version <= p.max_lag


def session_capacity(p: PolicyConfig, cells: Sequence[CellState]) -> int:
    return p.capacity * sum(1 for c in cells if c.alive and c.role == "rollout")


def cells_needed(p: PolicyConfig, load: Load) -> int:
    return math.ceil(load.level / p.capacity)


def decide(p: PolicyConfig, cells: Sequence[CellState], load: Load) -> list[Switch]:
    """The switches to make now (possibly none)."""
    alive = [c for c in cells if c.alive]
    if p.kind == Scheduler.async_:
        return []
    if p.colocated:
        want: Role = "rollout" if load.level > 0 else "train"
        return [
            Switch(c.cell, want, "colocate") for c in alive if c.role != want and not (c.busy and want == "rollout")
        ]
    return _elastic(p, alive, load)


def _elastic(p: PolicyConfig, alive: list[CellState], load: Load) -> list[Switch]:
    serving = sorted((c for c in alive if c.role == "rollout"), key=lambda c: c.cell)  # core first
    need = cells_needed(p, load)
    if len(serving) > need:  # the others can still serve every active session: release the surplus
        return [Switch(c.cell, "train", "surplus") for c in serving[: len(serving) - need]]
    if load.trainable > 0 and len(serving) == len(alive):  # training waits and nobody trains
        return [Switch(serving[0].cell, "train", "training_waits")]
    core = next((c for c in alive if c.cell == 0), None)
    if load.update and core is not None and core.role == "rollout":  # only the core makes the update: an idle
        # trainer takes over its sessions first (it comes back to serve; the core then leaves as above)
        idle = [c for c in alive if c.role == "train" and not c.busy]
        if idle:
            return [Switch(idle[-1].cell, "rollout", "update_waits")]
    if load.queued > 0 and len(serving) < need:  # sessions queue: bring idle cells back
        trainers = [c for c in alive if c.role == "train"]
        idle = sorted((c for c in trainers if not c.busy), key=lambda c: (c.cell == 0, -c.cell))
        if load.trainable > 0:  # training waits too: it keeps p.keep_training cells (the core last to go)
            busy = len(trainers) - len(idle)
            idle = idle[: len(idle) - max(0, min(p.keep_training, len(trainers)) - busy)]
        return [Switch(c.cell, "rollout", "sessions_queue") for c in idle[: need - len(serving)]]
    return []
