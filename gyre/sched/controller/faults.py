"""Faults injected on purpose (`sched.faults`), to show that a run survives them.

- `kill_cell:<cell>:after_micro_batches:<n>`: SIGKILL the cell's rank right after its n-th micro-batch
  assignment is sent, so it dies mid-step holding training work.
- `kill_engine:<cell>:after_calls:<n>`: once the proxy has served n calls, SIGKILL the cell's engine
  while it has requests in flight.
- `unreachable_engine:<cell>:after_calls:<n>`: once the proxy has served n calls (0: before the first),
  the controller sees the cell's engine at an address where nothing listens, as when a node advertises
  an address the others cannot reach; the cell should be declared dead (gyre.sched.controller.orchestrator).
- `stall_start:<cell>:attempts:<n>`: on the first n starts of a Slurm cell job under the script's
  start-up guard, the cell's rank stalls before the MPI world is up, as a hung MPI_Init would (the
  guard ends and reruns the start); ignored elsewhere, where nothing would end the stall.
Cells are numbered as in gyre.comm.control (0 is the core at rank 1).
"""

from __future__ import annotations

import os
import signal
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from gyre.sched.controller.cell_table import Cell, CellTable, kill_pid

TRIGGERS = {
    "kill_cell": "after_micro_batches",
    "kill_engine": "after_calls",
    "unreachable_engine": "after_calls",
    "stall_start": "attempts",
}


@dataclass
class Fault:
    kind: str
    cell: int
    n: int
    fired: bool = False


def parse_faults(specs: list[str]) -> list[Fault]:
    faults = []
    for spec in specs:
        parts = spec.split(":")
        if len(parts) != 4 or parts[0] not in TRIGGERS or parts[2] != TRIGGERS[parts[0]]:
            allowed = ", ".join(f"{k}:<cell>:{v}:<n>" for k, v in TRIGGERS.items())
            raise ValueError(f"sched.faults entry {spec!r} is not one of {allowed}")
        faults.append(Fault(parts[0], int(parts[1]), int(parts[3])))
    return faults


def stalls_start(specs: list[str], cell: int, attempt: int) -> bool:
    """Whether this start attempt of the cell's rank stalls before the world is up (stall_start)."""
    return any(f.kind == "stall_start" and f.cell == cell and attempt <= f.n for f in parse_faults(specs))


class FaultInjector:
    def __init__(self, specs: list[str], n_cells: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.faults = parse_faults(specs)
        self.clock = clock  # each logged fault's "t" (the controller's timeline: as its metrics rows)
        if bad := [f.cell for f in self.faults if not 0 <= f.cell < n_cells]:
            raise ValueError(f"sched.faults names cells {bad}; cells are 0..{n_cells - 1}")
        if any(f.kind in ("kill_cell", "unreachable_engine") and f.cell == 0 for f in self.faults):
            raise ValueError("sched.faults cannot kill cell 0: the core holds the only optimizer state")
        self.log: list[dict] = []

    def after_assignment(self, cell: Cell) -> None:
        for f in self.faults:
            if f.kind == "kill_cell" and not f.fired and f.cell == cell.index and cell.micro_batches >= f.n:
                f.fired = True
                kill_pid(cell.pid, signal.SIGKILL)
                self.log.append({"fault": "kill_cell", "cell": cell.index, "pid": cell.pid, "t": self._now()})

    def _now(self) -> float:
        return round(self.clock(), 3)

    def hide_engines(self, table: CellTable, calls_served: int) -> list[tuple[str, str]]:
        """unreachable_engine faults due now: (old, new) engine URLs, the new one refusing connections."""
        moved = []
        for f in self.faults:
            if f.kind == "unreachable_engine" and not f.fired and calls_served >= f.n and table.cells[f.cell].alive:
                f.fired = True
                cell = table.cells[f.cell]
                parts = urllib.parse.urlsplit(cell.engine_url)
                old, cell.engine_url = cell.engine_url, parts._replace(netloc=f"{parts.hostname}:1").geturl()
                moved.append((old, cell.engine_url))
                self.log.append(
                    {"fault": "unreachable_engine", "cell": cell.index, "engine_url": cell.engine_url, "t": self._now()}
                )
        return moved

    def tick(self, table: CellTable, calls_served: int, in_flight: dict[str, int]) -> None:
        for f in self.faults:
            if f.kind != "kill_engine" or f.fired or calls_served < f.n:
                continue
            cell = table.cells[f.cell]
            if cell.alive and cell.role == "rollout" and in_flight.get(cell.engine_url, 0) > 0:
                f.fired = True
                try:
                    os.killpg(cell.engine_pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.log.append(
                    {"fault": "kill_engine", "cell": cell.index, "engine_pid": cell.engine_pid, "t": self._now()}
                )
