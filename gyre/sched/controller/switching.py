"""Carrying out role switches, and timing each one.

rollout -> train: the cell's capacity leaves the admission count, its engine leaves the proxy and its
in-flight requests move to the remaining engines with their keys/values (gyre.sched.controller.reroute), then the
cell releases its engine's memory. train -> rollout: the cell resumes its engine at the newest
weights, then the proxy routes to it and its capacity counts again. A switch's latency runs from the
controller's decision to the cell's ack (cells switched together share it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gyre.comm.messages import Ack, RoleSwitch
from gyre.engine.client import EngineError
from gyre.proxy.server import ProxyServer
from gyre.sched.controller.cell_table import Cell, CellDied
from gyre.sched.controller.context import ControllerContext
from gyre.sched.controller.reroute import Migration, take_out_of_service
from gyre.sched.controller.sessions import RolloutDriver
from gyre.sched.policy import Switch, session_capacity


class Switcher:
    def __init__(self, ctx: ControllerContext, proxy: ProxyServer, driver: RolloutDriver) -> None:
        self.cfg, self.policy, self.table, self.outbox = ctx.cfg, ctx.policy, ctx.table, ctx.outbox
        self.timeline, self.metrics = ctx.timeline, ctx.metrics
        self.proxy, self.driver = proxy, driver
        self.latencies: dict[str, list[float]] = {"rollout->train": [], "train->rollout": []}
        self.migrated = {
            "migrated_sessions": 0,
            "migrated_tokens": 0,
            "would_recompute_tokens": 0,
            "migrated_idle_sessions": 0,
            "migrated_idle_tokens": 0,
        }

    def update_capacity(self) -> None:
        states = self.table.states(lambda c: False)
        self.driver.set_capacity(session_capacity(self.policy, states))

    def apply(self, switches: list[Switch], on_other: Callable[[Any, Ack], None], record: bool = True) -> list[int]:
        """Make the switches (releases first); returns the ranks found dead meanwhile."""
        dead: list[int] = []
        reasons = {s.cell: s.reason for s in switches}
        for role in ("train", "rollout"):
            cells = [self.table.cells[s.cell] for s in switches if s.role == role and self.table.cells[s.cell].alive]
            if cells:
                dead += self._switch(cells, role, on_other, record, reasons)
        return dead

    def _switch(
        self, cells: list[Cell], role: str, on_other: Callable[[Any, Ack], None], record: bool, reasons: dict[int, str]
    ) -> list[int]:
        start = time.monotonic()
        level = sum(self.driver.level(evals=False))  # training sessions: the decision saw these or more
        eval_sessions = self.driver.eval_level()
        before = {c.index: c.role for c in cells}
        migrations: dict[int, Migration] = {}
        for c in cells:
            self.timeline.set_role(c.index, "switching")
        if role == "train":
            for c in cells:
                c.role = "train"  # its sessions' capacity goes first, so no new session counts on it
            self.update_capacity()
            for c in cells:
                if c.engine_url in self.proxy.engines():
                    try:
                        m = take_out_of_service(c.engine_url, self.proxy, self.cfg.sched.kv_migration)
                    except EngineError as e:  # its engine died: the proxy reroutes (and recomputes)
                        self.proxy.set_engines([u for u in self.proxy.engines() if u != c.engine_url])
                        m = Migration(c.engine_url, failed=[str(e)])
                    migrations[c.index] = m
                    for key, value in (("sessions", m.sessions), ("tokens", m.tokens)):
                        self.migrated[f"migrated_{key}"] += value
                    self.migrated["migrated_idle_sessions"] += m.idle_sessions
                    self.migrated["migrated_idle_tokens"] += m.idle_tokens
                    self.migrated["would_recompute_tokens"] += m.would_recompute
        msgs = {c.rank: RoleSwitch(c.index, role) for c in cells}  # type: ignore[arg-type]
        try:
            acks = self.outbox.call(msgs, on_other, lambda: [c.rank for c in self.table.newly_dead()])
        except CellDied as e:
            return e.ranks
        for c in [c for c in cells if acks[c.rank].error]:  # excused (the run is stopping): it keeps its role
            self.timeline.set_role(c.index, before[c.index])
            c.role = before[c.index]
        cells = [c for c in cells if not acks[c.rank].error]
        latency = time.monotonic() - start
        for c in cells:
            detail = acks[c.rank].detail
            c.role, c.engine_url, c.engine_pid = role, detail["engine_url"].rstrip("/"), detail["engine_pid"]  # type: ignore[assignment]
            self.timeline.set_role(c.index, role)
        if role == "rollout":
            self.proxy.set_engines([*self.proxy.engines(), *(c.engine_url for c in cells)])
            self.update_capacity()
        latency = time.monotonic() - start if role == "rollout" else latency
        for c in cells:
            direction = f"{before[c.index]}->{role}"
            if record and before[c.index] != role:
                self.latencies.setdefault(direction, []).append(latency)
            row = {"event": "switch", "cell": c.index, "direction": direction, "latency_s": round(latency, 4)}
            row |= {"t": round(self.timeline.now(), 3), "together": len(cells), "initial": not record}
            row |= {"cell_s": round(acks[c.rank].detail["seconds"], 4), "level": level, "eval_sessions": eval_sessions}
            row |= {"serving_after": len(self.table.serving()), "reason": reasons.get(c.index, "")}
            self.metrics.write(row | (migrations[c.index].metrics() if c.index in migrations else {}))
            if record and before[c.index] != role:
                print(switch_line(row, migrations.get(c.index)), flush=True)
        return []


def switch_line(row: dict[str, Any], migration: Migration | None) -> str:
    """The progress line of one role switch: which cell, which way, how long, why, and what moved with it."""
    moved = f", {migration.sessions} sessions moved" if migration is not None and migration.sessions else ""
    why = f": {row['reason']}" if row["reason"] else ""
    return (f"gyre: switch cell {row['cell']} {row['direction']} in {row['latency_s']:.2f} s at t={row['t']:.0f} s "
            f"(sessions {row['level']}, {row['serving_after']} cells serving{moved}){why}")  # fmt: skip
