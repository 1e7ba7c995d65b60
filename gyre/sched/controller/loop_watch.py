"""How long the controller's loop stands still in each of its phases, and what each policy decision saw.

A decision is only as fresh as the loop that takes it: while the loop writes a shard or waits for a
switch, finished sessions and idle cells go unseen. Each step's row carries the longest time any phase
held the loop during the step (`loop_max_s`), and each decision that moves cells is logged with the
state the policy saw and how long the loop had been busy since it last woke (`loop_s`), so a slow
decision shows in the event log.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from gyre.sched.policy import CellState, Load, Switch


class LoopWatch:
    def __init__(self) -> None:
        self.longest: dict[str, float] = {}  # phase -> the longest it held the loop since the last take()
        self.longest_cpu: dict[str, float] = {}  # phase -> the most CPU the loop's thread spent in one pass
        self.others_cpu: dict[str, float] = {}  # phase -> in its longest pass, CPU the process's other threads used
        self.woke = time.monotonic()  # when the loop last woke (news, or its poll's time-out)

    def wake(self) -> None:
        self.woke = time.monotonic()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start, cpu, process = time.monotonic(), time.thread_time(), time.process_time()
        try:
            yield
        finally:
            wall, mine = time.monotonic() - start, time.thread_time() - cpu
            if wall >= self.longest.get(name, 0.0):
                self.longest[name] = wall
                self.others_cpu[name] = max(0.0, time.process_time() - process - mine)
            self.longest_cpu[name] = max(self.longest_cpu.get(name, 0.0), mine)

    def take(self) -> dict[str, dict[str, float]]:
        """The longest time each phase held the loop since the last take (a step's row), in wall seconds; the
        most CPU seconds the loop's thread spent in one pass of it; and, during the longest pass, the CPU
        seconds the controller's other threads (proxy, rollout driver, shard writer) used. A wall far above
        the loop's CPU is waiting: for the interpreter lock when the other threads' CPU fills it, else for a
        CPU (a loaded machine)."""
        out = {
            "loop_max_s": _rounded(self.longest),
            "loop_max_cpu_s": _rounded(self.longest_cpu),
            "loop_max_others_cpu_s": _rounded(self.others_cpu),
        }
        self.longest, self.longest_cpu, self.others_cpu = {}, {}, {}
        return out

    def decision_row(
        self, switches: Sequence[Switch], cells: Sequence[CellState], load: Load, decide_s: float
    ) -> dict[str, Any]:
        """The event row of one decision that moves cells: what it saw, what it chose, how late."""
        return {
            "event": "decision",
            "switches": [[s.cell, s.role, s.reason] for s in switches],
            "cells": [[c.cell, c.role, c.busy] for c in cells if c.alive],
            "queued": load.queued,
            "running": load.running,
            "trainable": load.trainable,
            "update": load.update,
            "decide_s": round(decide_s, 5),
            "loop_s": round(time.monotonic() - decide_s - self.woke, 4),
        }


def _rounded(d: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in sorted(d.items())}
