"""Typed control-plane messages between the controller (MPI rank 0) and the ranks of the cells.

Each message is a small dataclass, pickled by mpi4py and wrapped in an `Envelope` that numbers it,
so that the `Ack` a rank sends back names the request it answers. No torch here: the payloads are
plain Python (a weight announcement carries a transfer handle, itself a plain dataclass).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["rollout", "train"]
ROLES: tuple[Role, ...] = ("rollout", "train")


@dataclass(frozen=True)
class RoleSwitch:
    """The controller moves a cell to `role` (rollout: serve engines; train: join the training step)."""

    cell: int
    role: Role

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")


@dataclass(frozen=True)
class StepStart:
    step: int
    weight_version: str


@dataclass(frozen=True)
class StepEnd:
    step: int
    weight_version: str  # the version the step produced
    stats: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightVersion:
    """New weights are available: `handle` says where to pull them from (see gyre.comm.transfer)."""

    version: str
    handle: Any = None
    peers: tuple[int, ...] = ()  # two-sided transports (gloo): the ranks the owner serves


@dataclass(frozen=True)
class MicroBatchRef:
    """Micro-batch `index` of a shard's packing (gyre.pipeline.rl_micro_batches over its trainable rollouts)."""

    shard: str
    index: int
    tokens: int = 0


@dataclass(frozen=True)
class MicroBatchAssignment:
    step: int
    micro_batches: tuple[int, ...]
    refs: tuple[MicroBatchRef, ...] = ()  # where each micro-batch comes from, in the order of micro_batches


@dataclass(frozen=True)
class Hello:
    """The controller asks a cell for what it needs to drive it (engine URL, process ids, host); the cell
    connects to `liveness` ("host:port"), so that its death is seen at once (gyre.sched.liveness)."""

    liveness: str = ""


@dataclass(frozen=True)
class GradientReduce:
    """End of a training step: each contributor sends its summed gradients to the core, which scales the
    total by `scale`, steps the optimizer and publishes the weights as `version`."""

    step: int
    core_rank: int
    contributors: tuple[int, ...]  # ranks whose gradients enter the sum (the core's own if listed)
    scale: float
    version: str


@dataclass(frozen=True)
class SaveCheckpoint:
    """The core writes the run's checkpoint (its trainer: weights and optimizer, and `state`, the
    controller's RunState as JSON) under the run's output directory (gyre.resume.checkpoint)."""

    state: dict[str, Any] = field(default_factory=dict)
    final: bool = False  # acknowledged once on disk (a stop); else once snapshotted, written in the background


@dataclass(frozen=True)
class Shutdown:
    reason: str = ""
    finalize: bool = True  # False once a rank died: MPI_Finalize would wait for it forever, so everyone skips it


@dataclass(frozen=True)
class Ack:
    """A rank's answer to message `seq`; `detail` holds what the handler returned (timings, counts)."""

    seq: int
    rank: int
    cell: int
    detail: dict[str, Any] = field(default_factory=dict)
    error: str = ""


Message = (
    RoleSwitch | StepStart | StepEnd | WeightVersion | MicroBatchAssignment | Hello | GradientReduce | Shutdown | Ack
)


@dataclass(frozen=True)
class Envelope:
    seq: int
    src: int
    body: Message
    sent_at: float = 0.0  # time.time() at the sender, for switch-latency metrics
