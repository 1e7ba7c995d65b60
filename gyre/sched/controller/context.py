"""What the controller's collaborators share (the train plane, the switcher), built once by the Controller
rather than passed to each as a list of its parts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gyre.config.schema import RunConfig
from gyre.metrics import MetricsWriter
from gyre.sched.controller.cell_table import CellTable, Outbox
from gyre.sched.controller.timeline import Timeline
from gyre.sched.policy import PolicyConfig


@dataclass(frozen=True)
class ControllerContext:
    """The run's config and directory, the policy's view of it, the cells (their table, and the outbox that
    reaches them), and the clock and writer that record what happened."""

    cfg: RunConfig
    out: Path
    policy: PolicyConfig
    table: CellTable
    outbox: Outbox
    timeline: Timeline
    metrics: MetricsWriter
