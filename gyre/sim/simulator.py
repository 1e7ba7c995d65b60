"""A discrete-event simulation of a cell job that runs the production scheduling code on a simulated clock.

What is simulated: the sessions (their calls on the rollout engines, their tool time, admission under
the session capacity, as gyre.sched.controller.sessions does), the cells' training work, and the time the
controller spends blocked in role switches, shard writes, gradient reductions and weight syncs. What
is not: every decision. The controller's loop here is gyre.sched.controller.orchestrator.Controller.run step by
step: `may_start` admits steps, completed groups put their micro-batches in a `MicroBatchLedger`,
`step_ready` closes a step, `gyre.sched.policy.decide` moves cells (releases first, then returns, as
gyre.sched.controller.switching.Switcher.apply does), and `hand_out` streams micro-batches to training cells.
A change to any of them changes the simulation.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gyre.comm.messages import MicroBatchRef
from gyre.sched import policy
from gyre.sched.policy import ledger as ledger_rules
from gyre.sched.policy.admission import AdmissionOrder
from gyre.sim.workload import CellModel, Rollout, RunShape


class RolloutSource(Protocol):
    def sample(self, step: int, shape: RunShape) -> list[Rollout]: ...


@dataclass
class _Session:
    step: int
    rollout: Rollout
    started: float
    segment: int = 0
    calling: bool = False
    token: int = 0  # events of an earlier phase carry another token and are dropped
    in_cpu: bool = False  # in its own CPU work (start-up, grading)


@dataclass
class SimResult:
    scheduler: str
    wall_s: float
    step_end_s: list[float]
    role_seconds: dict[str, float]  # cell-seconds by role: rollout, train, switching
    train_busy_s: float  # cell-seconds spent on micro-batches
    session_s: float  # session-seconds (capacity held)
    timeouts: int
    switches: dict[str, int]
    n_cells: int
    capacity: int
    decisions: int = 0
    segments: list[tuple[int, str, float, float]] = field(default_factory=list)
    # what contention each piece of work met (gyre.sim.predict.fit_costs divides it out of measured costs):
    # rollout id -> CPU jobs when its own CPU work began; (rollout id, call) -> (calls per serving cell, CPU jobs)
    cpu_jobs_at_start: dict[str, float] = field(default_factory=dict)
    call_contention: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)
    train_slowdown: float = 1.0  # micro-batches' slowdown on the shared CPUs, weighted by their seconds
    cpu_jobs_at_end: dict[str, float] = field(default_factory=dict)  # rollout id -> CPU jobs when its grading began
    # cell-seconds of no work: training cells without a micro-batch and serving cells' empty slots (as shares of
    # a cell), while sessions queued for a slot and while none did (none admitted: the staleness bound)
    idle_s: dict[str, float] = field(default_factory=dict)

    @property
    def utilisation(self) -> float:
        """Share of cell-seconds doing work: training micro-batches, or holding a session (a session
        holds 1/capacity of a rollout cell)."""
        used = self.train_busy_s + self.session_s / self.capacity
        return used / (self.n_cells * self.wall_s) if self.wall_s else 0.0


class Simulation:
    def __init__(self, scheduler: str, cell: CellModel, shape: RunShape, source: RolloutSource) -> None:
        self.p = policy.PolicyConfig(
            scheduler, shape.n_cells, cell.capacity, shape.staleness, shape.async_rollout_cells, shape.keep_training
        )
        self.cell, self.shape, self.source = cell, shape, source
        self.t = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        # the cells
        self.roles: list[str] = ["rollout"] * shape.n_cells
        self.n_serving = shape.n_cells
        self.serving_capacity = 0
        self.train_queue: dict[int, deque[MicroBatchRef]] = {c: deque() for c in range(shape.n_cells)}
        self.training_now: set[int] = set()
        self.fresh: set[int] = set()  # cells that have not trained since they began training
        self._role_since = [0.0] * shape.n_cells
        self.role_seconds: dict[str, float] = {}
        self.segments: list[tuple[int, str, float, float]] = []
        # the sessions (the rollout driver's view)
        self.queue: deque[_Session] = deque()
        self.order = AdmissionOrder(shape.admission)
        self.running: dict[str, _Session] = {}
        self.in_call = 0
        self.done_inbox: list[_Session] = []
        self.in_cpu = 0  # sessions in their own CPU work
        self.writer_free = 0.0  # when the writer's thread is done with the groups handed to it
        self._train_alone = 0.0  # micro-batch seconds without contention
        self.cpu_jobs_at_start: dict[str, float] = {}
        self.cpu_jobs_at_end: dict[str, float] = {}
        self.call_contention: dict[tuple[str, int], tuple[float, float]] = {}
        # the controller's books
        self.ledger = ledger_rules.MicroBatchLedger()
        self.version = 0
        self.submitted = 0
        self.group_left: dict[tuple[int, int], int] = {}
        self.groups_left: dict[int, int] = {}
        self.group_tokens: dict[tuple[int, int], int] = {}
        self.blocked = False
        self.tick_due = False
        self.missed_news = False
        self.step_end: list[float] = []
        self.train_busy = 0.0
        self.session_s = 0.0
        self.timeouts = 0
        self.switches = {"rollout->train": 0, "train->rollout": 0}
        self.decisions = 0
        self.idle_s = {"sessions_queued": 0.0, "none_queued": 0.0}

    # ----- the clock -----
    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, fn))

    def run(self, max_events: int = 50_000_000) -> SimResult:
        initial = [policy.Switch(c, r) for c, r in enumerate(policy.initial_roles(self.p)) if r != "rollout"]
        self.update_capacity()
        self.blocked = self.missed_news = True  # the loop's first look comes after the initial switches
        self.apply(initial, record=False, then=self.unblock)
        n = 0
        while self._events and self.version < self.shape.steps:
            t, _, fn = heapq.heappop(self._events)
            self.count_idle(t - self.t)
            self.t = t
            fn()
            n += 1
            if n > max_events:
                raise RuntimeError(f"the simulation ran {max_events} events without finishing {self.shape.steps} steps")
        if self.version < self.shape.steps:
            raise RuntimeError(f"the simulation stalled at step {self.version} (t={self.t:.1f} s): nothing left to do")
        return self.result()

    def count_idle(self, dt: float) -> None:
        if dt <= 0:
            return
        trainers = sum(1 for c, r in enumerate(self.roles) if r == "train" and c not in self.training_now)
        empty = max(0, self.serving_capacity - len(self.running)) / self.cell.capacity
        self.idle_s["sessions_queued" if self.queue else "none_queued"] += (trainers + empty) * dt

    # ----- cells -----
    def set_role(self, c: int, role: str) -> None:
        prev = self.roles[c]
        self.role_seconds[prev] = self.role_seconds.get(prev, 0.0) + self.t - self._role_since[c]
        self.segments.append((c, prev, self._role_since[c], self.t))
        self.roles[c], self._role_since[c] = role, self.t
        self.n_serving = sum(1 for r in self.roles if r == "rollout")

    def states(self) -> list[policy.CellState]:
        role = {"switching": "rollout"}  # only seen while the controller is blocked in the switch
        return [
            policy.CellState(c, role.get(r, r), self.ledger.in_flight(c) > 0)  # type: ignore[arg-type]
            for c, r in enumerate(self.roles)
        ]

    def update_capacity(self) -> None:
        self.serving_capacity = policy.session_capacity(self.p, self.states())
        self.pump()

    # ----- sessions (gyre.sched.controller.sessions) -----
    def pump(self) -> None:
        started = []
        while self.queue and len(self.running) < self.serving_capacity:
            i = self.order.pick([(q.step, q.rollout.group) for q in self.queue], self.t)
            s = self.queue[i]
            del self.queue[i]
            self.order.started((s.step, s.rollout.group), s.rollout.rollout_id, self.t)
            s.started = self.t
            self.running[s.rollout.rollout_id] = s
            s.in_cpu = True
            self.in_cpu += 1
            started.append(s)
            if self.shape.timeout_s < math.inf:
                self.at(self.t + self.shape.timeout_s, self._timeout(s, s.token))
        jobs = self.cpu_jobs()  # sessions started together start their CPU work together
        for s in started:
            self.cpu_jobs_at_start[s.rollout.rollout_id] = jobs
            seconds = s.rollout.overhead_s + s.rollout.cpu_s * self.cell.slowdown(jobs)
            self.at(self.t + seconds, self._cpu_done(s, s.token))

    def cpu_jobs(self) -> float:
        """Jobs on the shared CPUs now: sessions in their own CPU work, engines with calls in flight, training
        cells with a micro-batch."""
        return self.in_cpu + min(self.in_call, self._serving()) + len(self.training_now)

    def _cpu_done(self, s: _Session, token: int) -> Callable[[], None]:
        def fn() -> None:
            if s.token != token:
                return
            s.in_cpu = False
            self.in_cpu -= 1
            self._next_call(s, token)()

        return fn

    def _serving(self) -> int:
        return max(1, self.n_serving)

    def _next_call(self, s: _Session, token: int) -> Callable[[], None]:
        def fn() -> None:
            if s.token != token:
                return
            if s.segment >= len(s.rollout.calls):
                self.session_done(s)
                return
            call = s.rollout.calls[s.segment]
            s.calling = True
            self.in_call += 1
            per_cell, jobs = self.in_call / self._serving(), self.cpu_jobs()
            self.call_contention[(s.rollout.rollout_id, s.segment)] = (per_cell, jobs)
            seconds = self.cell.call_seconds(call, per_cell) * self.cell.slowdown(jobs)
            self.at(self.t + seconds, self._call_done(s, token))

        return fn

    def _call_done(self, s: _Session, token: int) -> Callable[[], None]:
        def fn() -> None:
            if s.token != token:
                return
            self.in_call -= 1
            s.calling = False
            call = s.rollout.calls[s.segment]
            s.segment += 1
            self.at(self.t + call.tool_s, self._next_call(s, token))

        return fn

    def _timeout(self, s: _Session, token: int) -> Callable[[], None]:
        def fn() -> None:
            if s.token != token or s.rollout.rollout_id not in self.running:
                return
            self.timeouts += 1
            if s.calling:
                self.in_call -= 1
            if s.in_cpu:
                s.in_cpu = False
                self.in_cpu -= 1
            self.session_done(s)

        return fn

    def session_done(self, s: _Session) -> None:
        """The harness ended: its slot goes to the next session, then it is graded (as the driver does)."""
        s.token += 1
        r = s.rollout
        del self.running[r.rollout_id]
        self.order.ended((s.step, r.group), r.rollout_id, self.t)
        self.session_s += self.t - s.started
        if not (r.end_s or r.end_cpu_s):
            self.pump()
            self._graded(s)
            return
        self.in_cpu += bool(r.end_cpu_s)
        self.pump()
        jobs = self.cpu_jobs_at_end[r.rollout_id] = self.cpu_jobs()
        self.at(self.t + r.end_s + r.end_cpu_s * self.cell.slowdown(jobs), lambda: self._graded(s))
        self.news()  # the level changed: the controller looks (the driver's slot_freed)

    def _graded(self, s: _Session) -> None:
        self.in_cpu -= bool(s.rollout.end_cpu_s)
        self.done_inbox.append(s)
        self.news()

    # ----- the controller (gyre.sched.controller.orchestrator.Controller.run) -----
    def news(self) -> None:
        if self.blocked:
            self.missed_news = True  # seen once the controller looks again
        elif not self.tick_due:
            self.tick_due = True
            self.at(self.t, self.tick)

    def block(self, seconds: float, then: Callable[[], None]) -> None:
        self.blocked = True
        self.at(self.t + seconds, then)

    def unblock(self) -> None:
        """The controller looks again at once if anything happened meanwhile; else it waits for news."""
        self.blocked = False
        if self.missed_news:
            self.missed_news = False
            self.news()

    def tick(self) -> None:
        self.tick_due = False
        if self.blocked or self.version >= self.shape.steps:
            return
        self.admit()
        written = self.collect_sessions()
        if written:  # the controller writes each completed group's shard before it looks again
            self.missed_news = True
            self.block(written * self.cell.group_write_s, self.unblock)
            return
        if ledger_rules.step_ready(
            self.ledger, self.version, self.all_groups_in(self.version), self.roles[0] == "train"
        ):
            self.block(self.cell.reduce_s + self.cell.sync_s, self.finish_step)
            return
        switches = policy.decide(self.p, self.states(), self.load())
        self.decisions += 1
        self.blocked = True
        self.missed_news = self.missed_news or bool(switches)  # roles changed: the next look may decide more
        self.apply(switches, record=True, then=self.after_switches)

    def after_switches(self) -> None:
        self.assign()
        self.unblock()

    def admit(self) -> None:
        while self.submitted < self.shape.steps and policy.may_start(self.p, self.submitted, self.version):
            step = self.submitted
            rollouts = self.source.sample(step, self.shape)
            for r in rollouts:
                key = (step, r.group)
                self.group_left[key] = self.group_left.get(key, 0) + 1
                self.group_tokens[key] = self.group_tokens.get(key, 0) + r.train_tokens
                self.queue.append(_Session(step, r, 0.0))
            self.groups_left[step] = len({r.group for r in rollouts})
            self.submitted += 1
        self.pump()

    def collect_sessions(self) -> int:
        """Completed groups: written by the loop itself (returns how many, the loop blocks for them), or
        handed to the writer's thread (gyre.sched.controller.group_writer: one at a time, the loop goes on)."""
        completed = 0
        for s in self.done_inbox:
            key = (s.step, s.rollout.group)
            self.group_left[key] -= 1
            if self.group_left[key] == 0:
                if self.cell.group_write_blocks:
                    self.group_written(s.step, s.rollout.group)
                    completed += 1
                else:
                    self.writer_free = max(self.t, self.writer_free) + self.cell.group_write_s
                    self.at(self.writer_free, self._written(s.step, s.rollout.group))
        self.done_inbox = []
        return completed

    def group_written(self, step: int, group: int) -> None:
        self.ledger.add(step, self.plan_group(step, group))
        self.groups_left[step] -= 1

    def _written(self, step: int, group: int) -> Callable[[], None]:
        def fn() -> None:
            self.group_written(step, group)
            self.news()

        return fn

    def plan_group(self, step: int, group: int) -> list[MicroBatchRef]:
        tokens = self.group_tokens.pop((step, group))
        n = max(1, math.ceil(tokens / self.shape.micro_batch_tokens))
        sizes = [tokens // n + (1 if i < tokens % n else 0) for i in range(n)]
        return [MicroBatchRef(f"step{step}-group{group}", i, sz) for i, sz in enumerate(sizes)]

    def all_groups_in(self, step: int) -> bool:
        return self.groups_left.get(step, 1) == 0

    def load(self) -> policy.Load:
        step, groups_in = self.version, self.all_groups_in(self.version)
        if not step_open(self, step):
            return policy.Load(len(self.queue), len(self.running))
        trainable = ledger_rules.waiting_work(self.ledger, step, groups_in)
        update = ledger_rules.update_waits(self.ledger, step, groups_in)
        return policy.Load(len(self.queue), len(self.running), trainable, update)

    def apply(self, switches: list[policy.Switch], record: bool, then: Callable[[], None]) -> None:
        """Releases first, then returns; each a blocking call as long as the switch takes."""
        releases = [s.cell for s in switches if s.role == "train" and self.roles[s.cell] != "train"]
        returns = [s.cell for s in switches if s.role == "rollout" and self.roles[s.cell] != "rollout"]

        def do_returns() -> None:
            if not returns:
                then()
                return
            for c in returns:
                self.set_role(c, "switching")
            self.block(self.cell.to_rollout_s, finish_returns)

        def finish_returns() -> None:
            for c in returns:
                self.set_role(c, "rollout")
                self.switches["train->rollout"] += record
            self.update_capacity()
            then()

        def finish_releases() -> None:
            for c in releases:
                self.set_role(c, "train")
                self.fresh.add(c)
                self.switches["rollout->train"] += record
            do_returns()

        if not releases:
            do_returns()
            return
        moved = len(self.running) * len(releases) / max(1, self._serving())
        for c in releases:
            self.set_role(c, "switching")
        self.serving_capacity = policy.session_capacity(self.p, self.states_after(releases))
        self.block(self.cell.to_train_s + self.cell.kv_migration_s * moved, finish_releases)

    def states_after(self, releases: list[int]) -> list[policy.CellState]:
        return [policy.CellState(c.cell, "train" if c.cell in releases else c.role, c.busy) for c in self.states()]

    def assign(self) -> None:
        training = [c for c, r in enumerate(self.roles) if r == "train"]
        for c, ref in ledger_rules.hand_out(self.ledger, self.version, training, self.shape.micro_batches_in_flight):
            self.train_queue[c].append(ref)
            if c not in self.training_now:
                self._start_micro_batch(c)

    def _start_micro_batch(self, c: int) -> None:
        ref = self.train_queue[c].popleft()
        self.training_now.add(c)
        seconds = self.cell.micro_batch_seconds(ref.tokens) + self.cell.first_micro_batch_s * (c in self.fresh)
        slowdown = self.cell.slowdown(self.cpu_jobs())
        self._train_alone += seconds
        seconds *= slowdown
        self.fresh.discard(c)
        self.train_busy += seconds

        def done() -> None:
            self.training_now.discard(c)
            self.ledger.done(c, ref)
            if self.train_queue[c]:
                self._start_micro_batch(c)
            self.news()

        self.at(self.t + seconds, done)

    def finish_step(self) -> None:
        self.ledger.close_step(self.version)
        self.version += 1
        self.step_end.append(self.t)
        self.missed_news = True  # the loop goes round at once after a step (Controller.run: continue)
        self.unblock()

    def result(self) -> SimResult:
        for c in range(self.shape.n_cells):
            self.set_role(c, self.roles[c])
        for s in self.running.values():
            self.session_s += self.t - s.started
        return SimResult(
            self.p.kind,
            self.t,
            self.step_end,
            {k: round(v, 3) for k, v in self.role_seconds.items()},
            self.train_busy,
            self.session_s,
            self.timeouts,
            dict(self.switches),
            self.shape.n_cells,
            self.cell.capacity,
            self.decisions,
            self.segments,
            self.cpu_jobs_at_start,
            self.call_contention,
            self.train_busy / self._train_alone if self._train_alone else 1.0,
            self.cpu_jobs_at_end,
            {k: round(v, 3) for k, v in self.idle_s.items()},
        )


def step_open(sim: Simulation, step: int) -> bool:
    return step in sim.groups_left


def simulate(scheduler: str, cell: CellModel, shape: RunShape, source: RolloutSource, **kw: Any) -> SimResult:
    return Simulation(scheduler, cell, shape, source).run(**kw)
