"""The run's one orchestrator: the proxy, the harness sessions, the scheduler policy, shards, the step
clock, checkpoints and stops, metrics, the progress bar and the summary.

Every scheduler is a configuration of it: colocate (every cell switches together; one local cell runs in
this process, gyre.sched.launch.in_process), colocate_cells, async and elastic (cells as an MPI job, gyre.sched.launch.job).
The loop reacts to what happened since it last looked (sessions finished, micro-batches done, cells
died), lets the policy move cells between roles, and hands out training work; it sleeps between
looks (no spinning) and ends once the last step's weights are published.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from gyre.comm.address import engine_reachable
from gyre.comm.control import ControlError, ControlPlane
from gyre.comm.messages import Hello, RoleSwitch, SaveCheckpoint, Shutdown, WeightVersion
from gyre.config.schema import LogprobDistribution, RunConfig
from gyre.health import ExclusionWatch
from gyre.lifetime import pid_alive
from gyre.metrics import MetricsWriter, plot_learning_curve
from gyre.model.tokenizer import Tokenizer
from gyre.proxy.call_log import CallLog, CallRecord
from gyre.proxy.keys import RolloutKeys
from gyre.proxy.server import ProxyServer
from gyre.resume.preemption import Preempted
from gyre.resume.recovery import ResumePoint, checkpoint_due, describe_start, task_pool_position
from gyre.resume.state import RunState
from gyre.sandbox import make_sandbox
from gyre.sched.controller.cell_table import Cell, CellDied, CellTable, Outbox, kill_pid
from gyre.sched.controller.context import ControllerContext
from gyre.sched.controller.evaluation import EvalRunner
from gyre.sched.controller.faults import FaultInjector
from gyre.sched.controller.group_writer import GroupWriter, WrittenGroup
from gyre.sched.controller.loop_watch import LoopWatch
from gyre.sched.controller.report import progress, step_rows
from gyre.sched.controller.report import summary as summary_line
from gyre.sched.controller.sessions import RolloutDriver, SessionDone
from gyre.sched.controller.steps import StepBook
from gyre.sched.controller.switching import Switcher
from gyre.sched.controller.timeline import Timeline
from gyre.sched.controller.train_plane import TrainPlane
from gyre.sched.liveness import LivenessWatch
from gyre.sched.policy import Load, PolicyConfig, Switch, decide, initial_roles, may_start
from gyre.tracking import open_trackers

if TYPE_CHECKING:
    from gyre.sched.runtime import RunStart

# SIGTERM: Slurm preemption, `scontrol requeue`, the time-limit signal (the batch script forwards it through
# srun). Not SIGUSR1 in a cell job: mpiexec uses it to tell survivors that a rank died; in one process it
# is there for users' own tooling (gyre.resume.preemption)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)
IN_PROCESS_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


# Slurm signals every process of a step, each cell's engine too (the cells ignore the signal, the engines stop):
# a role switch or weight load that fails while the run stops is no error. An engine that died of the signal
# can report before the controller's own handler has run: the controller waits this long for it.
STEP_SIGNAL_GRACE_S = 3.0
ENGINE_PROBE_S = 15.0  # how long the controller tries to reach each engine before the first rollout
MAX_ENGINE_FAILURES = 5  # calls in a row an engine fails (the proxy routing around it) before its cell is dead


class StopRequest:
    """The first stop signal, noted from before any work (a resume's moves, the warm start) until the run
    ends; the controller checkpoints at the last completed step and stops when it next looks. Install from
    the main thread."""

    def __init__(self, in_process: bool = False) -> None:
        self.name = ""
        for sig in IN_PROCESS_STOP_SIGNALS if in_process else STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.name:
            return  # already stopping: Slurm signals every process and the batch shell forwards another
        self.name = signal.Signals(signum).name
        # os.write, not print: a handler may run in the middle of another print to the same stream
        os.write(2, f"\ngyre: {self.name} received: checkpointing and stopping now (rollouts in flight are "
                    "abandoned; an update in progress completes)\n".encode())  # fmt: skip

    def excuse(self, body: object, grace_s: float = STEP_SIGNAL_GRACE_S) -> str:
        """Why a cell's failed role switch or weight load (`body`) is no error: the stop signal, here now or within
        `grace_s`, reached the cell's engine too. "" otherwise (the failure is one). From the main thread."""
        if not isinstance(body, (RoleSwitch, WeightVersion)):
            return ""
        deadline = time.monotonic() + grace_s
        while not self.name and time.monotonic() < deadline:
            time.sleep(0.05)  # the signal's handler runs on this thread, between these sleeps
        if not self.name:
            return ""
        return f"after {self.name}, which reaches the engines too; the run stops at its last completed step"


def policy_config(cfg: RunConfig) -> PolicyConfig:
    """colocate: the cells share harness.concurrency sessions (all of a step's at once by default)."""
    s = cfg.sched
    n = 1 + len(cfg.cluster.satellites)
    capacity = math.ceil(cfg.harness.concurrency / n) if cfg.scheduler == "colocate" else s.capacity_per_cell
    return PolicyConfig(cfg.scheduler, n, capacity, s.staleness, s.async_rollout_cells)


def routing_shape(cfg: RunConfig) -> tuple[int, int] | None:
    """(MoE layers, top-k) of the run's model when rl.routing_replay is on: what the proxy asks each call's routed
    experts in; None when off."""
    if not cfg.rl.routing_replay:
        return None
    from gyre.model.moe import moe_layer_indices
    from gyre.model.pretrained import pretrained_model_config

    model = pretrained_model_config(cfg.model) if cfg.model.path else cfg.model
    return len(moe_layer_indices(model)), model.num_experts_per_tok


class Controller:
    def __init__(
        self,
        start: RunStart,
        cp: ControlPlane,
        tokenizer_dir: Path,
        point: ResumePoint | None = None,
        stop: StopRequest | None = None,
    ) -> None:
        cfg, out = start.cfg, start.out
        self.cfg, self.cp, self.out = cfg, cp, out
        self.stop_request = stop or StopRequest()
        self.pcfg = policy_config(cfg)
        self.metrics = MetricsWriter(out, open_trackers(cfg, out))
        self.timeline = Timeline(self.pcfg.n_cells)
        self.outbox = Outbox(cp, cfg.sched.cell_timeout_s, excuse=self.stop_request.excuse)
        self.call_log = CallLog(out / "calls.jsonl")
        truncated = cfg.rl.logprob_distribution is LogprobDistribution.truncated
        keys = RolloutKeys()
        self.proxy = ProxyServer(
            Tokenizer.load(tokenizer_dir),
            [],
            cfg.proxy,
            self.call_log,
            truncated_logprobs=truncated,
            keys=keys,
            routed_experts=routing_shape(cfg),
        )
        sandbox = make_sandbox(cfg.sandbox)  # fails here, before any cell works, when it cannot run
        self.driver = RolloutDriver(self.proxy.start(), out / "rollouts", cfg.harness, cfg.tasks, sandbox, keys)
        self.driver.set_admission(cfg.sched.admission)
        self.table = self.hello()
        self.faults = FaultInjector(cfg.sched.faults, self.pcfg.n_cells, self.timeline.now)
        point = point or ResumePoint(RunState(), None)
        self.book = StepBook(cfg, out, point.kept)
        self.writer = GroupWriter(cfg, self.book.shard_dir)  # shards written and planned off the loop
        self.watch = LoopWatch()
        self.evals = EvalRunner(cfg, out, self.book.pool) if cfg.eval.every else None
        ctx = ControllerContext(cfg, out, self.pcfg, self.table, self.outbox, self.timeline, self.metrics)
        self.train = TrainPlane(ctx, self.book, self.faults, self.cells_died, self.log)
        self.switcher = Switcher(ctx, self.proxy, self.driver)
        self.state = point.state  # completed steps (their rollouts, trained ids, shards), starts of the job
        self.state.begin()
        self.metrics.rows = list(point.metrics_rows)
        self.run_rows = step_rows(point.metrics_rows)  # every completed step's row, over every start
        self.eval_rows = [r for r in point.metrics_rows if r.get("event") == "eval"]
        print(describe_start(point, cfg, out), flush=True)
        self.train.version = self.state.next_step
        self.submitted = self.state.next_step  # steps whose sessions have been handed to the driver
        self.finalize = True  # False once a cell died (see gyre.sched.launch.job)
        self.step_rows: list[dict[str, Any]] = []
        self.exclusions = ExclusionWatch(cfg.rl.max_excluded_fraction, cfg.rl.max_excluded_steps)
        self.dead_reasons: dict[int, str] = {}  # cell -> why it was declared dead
        self.abandoned: set[int] = set()  # ranks declared dead whose process may still run (told to stop at the end)

    def hello(self) -> CellTable:
        liveness = LivenessWatch(self.cfg.comm.hostname or "127.0.0.1")  # rank 0's address, as its preflight found
        leaders = self.cp.layout.leaders
        acks = self.cp.request(leaders, Hello(liveness.address), timeout=self.cfg.sched.cell_timeout_s)
        unwatched = liveness.identify(leaders)
        cells = []
        for ack in acks:
            d = ack.detail
            cells.append(
                Cell(
                    d["cell"],
                    ack.rank,
                    engine_url=d["engine_url"],
                    engine_pid=d["engine_pid"],
                    pid=d["pid"],
                    host=d["host"],
                    remote_followers=tuple(r["rank"] for r in d.get("ranks", [])[1:] if r["host"] != d["host"]),
                )
            )
            self.timeline.set_role(d["cell"], "rollout")
            if ack.rank in unwatched:
                why = d.get("liveness_error") or "it did not connect"
                print(f"gyre: cell {d['cell']}: no liveness connection ({why}); its death is seen only after "
                      f"sched.cell_timeout_s={self.cfg.sched.cell_timeout_s:g} s without an answer", flush=True)  # fmt: skip
        (self.out / "cells.json").write_text(json.dumps([a.detail for a in acks], indent=1))
        return CellTable(sorted(cells, key=lambda c: c.index), liveness)

    # ----- the loop -----
    def run(self) -> None:
        """Until the last step's weights are published; raises Preempted (checkpointed, cells shut down)
        after a stop signal."""
        start = time.monotonic()
        self.bar = tqdm(
            desc="gyre", unit="step", dynamic_ncols=True, initial=self.state.next_step, total=self.cfg.steps
        )
        self.timeline.start_clock()
        initial = [Switch(c, r) for c, r in enumerate(initial_roles(self.pcfg)) if r != "rollout"]
        self.check_engines_reachable()
        self.proxy.set_engines([c.engine_url for c in self.table.serving()])
        self.cells_died(self.switcher.apply(initial, self.train.on_ack, record=False))
        self.switcher.update_capacity()
        self.start_eval()  # before the first step: the baseline
        while self.train.version < self.cfg.steps or self.eval_in_flight:
            if self.stop_signal:
                self.stop(time.monotonic() - start)
            self.admit()
            with self.watch.phase("sessions"):  # completed groups go to the writer
                self.collect_sessions()
            with self.watch.phase("groups"):  # written and planned ones come back
                self.collect_groups()
            self.collect_acks()
            self.check_health()
            if self.train.ready():
                self.finish_step()
                continue
            self.decide_and_switch()
            self.train.assign()
            self.sample_level()
            self.cp.wait_for(lambda: True if self.has_news() else None, 0.25)
            self.watch.wake()
        self.finish(time.monotonic() - start)

    @property
    def eval_in_flight(self) -> bool:
        return self.evals is not None and self.evals.in_flight

    def start_eval(self) -> None:
        """Evaluate the current weights when an eval is due: while it owns the cells (admit waits for it), or
        as lowest-priority rollout work, where an eval still in flight when the next one comes due is
        abandoned for it (so no eval is served by weights newer than the next due version's)."""
        version = self.train.version
        if self.evals is None or not self.evals.due(version) or self.evals.version == version:
            return
        if any(r.get("version") == version for r in self.eval_rows):  # a resume's repeat
            return
        if self.evals.in_flight:
            self.driver.drop_evals()
            self.log(self.evals.abandon(version))
        self.driver.submit(self.evals.open(version))

    @property
    def eval_owns_the_cells(self) -> bool:
        """An eval in flight now has the rollout cells to itself: under colocate every eval (between a step's
        update and the next step's rollouts); otherwise the baseline, before the first step's sessions are
        admitted, and the last version's, after the last step. Any other eval takes only idle slots."""
        if not self.eval_in_flight:
            return False
        return self.pcfg.colocated or self.submitted == 0 or self.train.version >= self.cfg.steps

    def admit(self) -> None:
        if self.eval_owns_the_cells:
            return
        while self.submitted < self.cfg.steps and may_start(self.pcfg, self.submitted, self.train.version):
            jobs, kept = self.book.open(self.submitted)
            for refs in kept:  # groups completed before a restart: trained, not run again
                self.train.ledger.add(self.submitted, refs)
            self.driver.submit(jobs)
            self.submitted += 1

    @property
    def stop_signal(self) -> str:
        """The stop signal's name once one came (SIGTERM, SIGUSR2; in one process SIGUSR1 too), else ""."""
        return self.stop_request.name

    def log(self, row: dict[str, Any]) -> None:
        self.metrics.write(row | {"t": round(self.timeline.now(), 3)})

    def collect_sessions(self) -> None:
        self.driver.slot_freed.clear()  # the level is read after this: a harness that ends later wakes the loop
        while not self.driver.events.empty() and not self.stop_signal:  # a stop kills harnesses: no results
            done = self.driver.events.get()
            ago = time.time() - done.started  # the driver's times are wall clock, the timeline's monotonic
            row = {"event": "session", "rollout_id": done.job.rollout_id, "step": done.job.step, "kind": done.job.kind}
            row |= {"started": round(self.timeline.now() - ago, 3), "seconds": round(done.ended - done.started, 3)}
            row |= {"queued_s": round(done.queued_s, 3)}
            if done.harness_ended:  # its slot was free from then on: its trace copied out, its workspace graded
                row |= {"grade_s": round(done.ended - done.harness_ended, 3)}
            if done.outcome is not None:  # the harness's own clock: model calls and tools, not start-up or grading
                row |= {"harness_s": done.outcome.wall_s, "turns": done.outcome.turns}
            self.log(row | ({"preempted": True} if done.preempted else {}))
            calls = self.call_log.pop_rollout(done.job.rollout_id)
            if done.preempted:  # an eval session whose slot training took: it runs again, from the start
                continue
            if done.job.kind == "eval":
                self.eval_finished(done, calls)
                continue
            group = self.book.finished(done, calls, self.out / "rollouts" / f"step{done.job.step:04d}")
            if group is not None:
                self.writer.submit(group)

    def collect_groups(self) -> None:
        """Groups the writer has written and planned: their micro-batches join the ledger (an eval's shards go to
        its runner)."""
        for w in self.writer.done():
            if w.kind == "eval":
                self.eval_written(w)
                continue
            refs = self.book.add_written(w)
            self.train.ledger.add(w.step, refs)
            row = {"event": "group", "step": w.step, "group": w.group, "micro_batches": len(refs)}
            # seconds: the writer's (scoring, writing, planning); waited_s: behind earlier groups
            self.log(row | {"seconds": round(w.write_s, 4), "waited_s": round(w.waited_s, 4), "blocked_s": 0.0})

    def decide_and_switch(self) -> None:
        """Ask the policy, log a decision that moves cells with what it saw, and make its switches; none once a
        stop signal came (the loop stops next)."""
        if self.stop_signal:
            return
        with self.watch.phase("decide"):
            t0 = time.monotonic()
            states, load = self.states(), self.load()
            switches = decide(self.pcfg, states, load)
            if switches:
                self.log(self.watch.decision_row(switches, states, load, time.monotonic() - t0))
        with self.watch.phase("switch"):
            self.cells_died(self.switcher.apply(switches, self.train.on_ack))

    def eval_finished(self, done: SessionDone, calls: list[CallRecord]) -> None:
        assert self.evals is not None
        if (job := self.evals.finished(done, calls)) is not None:
            self.writer.submit(job)

    def eval_written(self, group: WrittenGroup) -> None:
        assert self.evals is not None
        if (row := self.evals.written(group)) is not None:
            self.log(row)
            self.eval_rows.append(row)

    def collect_acks(self) -> None:
        for body, ack in self.outbox.pump():
            self.train.on_ack(body, ack)
        if overdue := self.outbox.overdue():
            self.cells_died(overdue)

    def check_engines_reachable(self) -> None:
        """Before the first rollout: a cell whose engine the proxy (here) cannot reach is a dead cell."""
        self.faults.hide_engines(self.table, 0)
        for c in self.table.alive():
            if error := engine_reachable(c.engine_url, ENGINE_PROBE_S):
                self.cells_died([c.rank], f"its engine at {c.engine_url} is unreachable from the controller ({error})")

    def failing_engines(self) -> None:
        """A cell whose engine keeps failing calls (the proxy routes around it) is a dead cell."""
        for old, new in self.faults.hide_engines(self.table, len(self.call_log)):
            self.proxy.set_engines([new if u == old else u for u in self.proxy.engines()])
        failing = self.proxy.dispatcher.failing_since_success
        for c in self.table.serving():
            n = failing.get(c.engine_url.rstrip("/"), 0)
            if n >= MAX_ENGINE_FAILURES and (not c.local or pid_alive(c.engine_pid)):
                self.cells_died([c.rank], f"its engine at {c.engine_url} failed {n} calls in a row")

    def check_health(self) -> None:
        self.cells_died(self.dead())
        self.failing_engines()
        self.faults.tick(self.table, len(self.call_log), self.proxy.router.in_flight())
        if self.stop_signal:  # the engines got it too: the run stops next, no engine is started again
            return
        for c in self.table.serving():  # an engine died under a living cell: route around it, start another
            if c.local and c.engine_pid > 0 and not pid_alive(c.engine_pid):
                self.proxy.set_engines([u for u in self.proxy.engines() if u != c.engine_url])
                row = {"event": "engine_died", "cell": c.index, "engine_pid": c.engine_pid}
                self.metrics.write(row | {"t": round(self.timeline.now(), 3)})
                try:
                    acks = self.outbox.call({c.rank: RoleSwitch(c.index, "rollout")}, self.train.on_ack, self.dead)
                except CellDied as e:
                    self.cells_died(e.ranks)
                    continue
                if acks[c.rank].error:  # excused: the run is stopping
                    continue
                c.engine_url, c.engine_pid = acks[c.rank].detail["engine_url"], acks[c.rank].detail["engine_pid"]
                self.proxy.set_engines([*self.proxy.engines(), c.engine_url])

    def abandon(self) -> None:
        """The run failed here: stop what would outlive the job (harness groups, every local engine)."""
        self.stop_watching()
        self.driver.close()
        self.writer.close(wait_s=5.0)
        for c in self.table.cells:
            if c.local and c.engine_pid > 0:
                kill_pid(c.engine_pid, signal.SIGKILL)

    def stop_engines_of_lost_cells(self) -> None:
        """Engines run in their own sessions: those of dead cells outlive their rank unless killed."""
        for c in self.table.cells:
            if not c.alive and c.local and c.engine_pid > 0:
                kill_pid(c.engine_pid, signal.SIGKILL)

    def dead(self) -> list[int]:
        return [c.rank for c in self.table.newly_dead()]

    def cells_died(self, ranks: list[int], reason: str = "") -> None:
        """`reason` given: the rank may still run (its engine is unreachable or failing); it is told to stop at
        the end. Without: its process is gone or it stopped answering."""
        for rank in ranks:
            c = self.table.by_rank(rank)
            if not c.alive:
                continue
            why = reason or ("its rank died" if self.table.process_gone(c) else "it stopped answering")
            if c.index == 0:
                raise RuntimeError(f"the core cell (rank {rank}) is lost: {why}; it holds the only optimizer state")
            print(f"gyre: cell {c.index} (rank {rank}, {c.host}) is dead: {why}", flush=True)
            self.dead_reasons[c.index] = why
            if reason:
                self.abandoned.add(rank)
            c.alive = False
            self.outbox.forget(rank)
            requeued = self.train.ledger.fail_cell(c.index)
            self.proxy.set_engines([u for u in self.proxy.engines() if u != c.engine_url])
            if c.local and c.engine_pid > 0:
                kill_pid(c.engine_pid, signal.SIGKILL)  # its engine outlives a killed rank otherwise
            self.timeline.set_role(c.index, "dead")
            row = {"event": "cell_died", "cell": c.index, "rank": rank, "requeued_micro_batches": len(requeued)}
            row["reason"] = why
            self.metrics.write(row | {"t": round(self.timeline.now(), 3), "role": c.role})
            self.switcher.update_capacity()

    def finish_step(self) -> None:
        step = self.train.version
        train = self.train.finish_step()
        rec = self.book.steps[step]
        row = {"event": "step", "step": step, **self.book.summary(step), **train}
        row["train/trained"] = float(bool(rec.trained_ids))  # an optimizer update on a gradient (none: skipped)
        row |= {"wall_s": round(time.monotonic() - rec.submitted, 3), "t": round(self.timeline.now(), 3)}
        row |= {"version": self.train.version, "continued_calls": self.proxy.dispatcher.continued}
        row |= {"continued_recomputed_tokens": self.proxy.dispatcher.continued_recomputed_tokens}
        row |= {"routed_around": self.proxy.dispatcher.routed_around}
        row |= {"engine_failures": sum(self.proxy.dispatcher.engine_failures.values())}
        row |= self.watch.take()  # the longest each phase of the loop held it during the step
        self.metrics.write(row)
        self.step_rows.append(row)
        self.run_rows.append(row)
        self.bar.set_postfix(progress(row) | {"v": str(self.train.version)}, refresh=False)
        self.bar.update()
        self.exclusions.observe(row)  # raises ExcludedRunError (the run abandoned): its row is in metrics.jsonl
        rejected = [rid for s in rec.shards for rid in s.rejected]  # no tree: not stored
        stored = [m.outcome.rollout_id for members in rec.groups.values() for m in members]
        stored = [rid for rid in stored if rid not in rejected]
        self.state.record_step(step, stored, rec.trained_ids, [s.path.name for s in rec.shards], rejected)
        if checkpoint_due(self.cfg, step):
            self.checkpoint()
        self.start_eval()

    def checkpoint(self, final: bool = False) -> None:
        """The core writes weights, optimizer and the run state of the completed steps (gyre/resume), in the
        background (its ack: once snapshotted); `final`: on disk before the ack."""
        self.state.data = task_pool_position(self.cfg, self.state.next_step)
        core = self.table.cells[0]
        try:
            message = SaveCheckpoint(self.state.to_json(), final)
            self.outbox.call({core.rank: message}, self.train.on_ack, self.dead)
        except CellDied as e:
            self.cells_died(e.ranks)  # the core: fatal

    def stop(self, wall_s: float) -> None:
        """Abandon the sessions in flight (their steps are re-run on resume), checkpoint at the last
        completed step if not done yet, shut the cells down, raise Preempted."""
        print(f"gyre: {self.stop_signal}: stopping at step {self.state.next_step}", flush=True)
        self.driver.close()
        self.checkpoint(final=True)
        self.finish(wall_s, stopped=self.stop_signal)
        print(f"gyre: stopped by {self.stop_signal} before step {self.state.next_step}; checkpoint in "
              f"{self.out / 'checkpoint'}; run the same command again to continue", flush=True)  # fmt: skip
        raise Preempted(self.stop_signal)

    # ----- what the policy sees -----
    def states(self) -> list:
        return self.table.states(self.train.busy)

    def load(self) -> Load:
        """Eval sessions count only while an eval owns the cells: otherwise they keep no cell serving and call
        none back (they hold only slots no training session wants, gyre.sched.controller.sessions)."""
        queued, running = self.driver.level(evals=self.eval_owns_the_cells)
        return Load(queued, running, self.train.waiting_work(), self.train.update_waits())

    def sample_level(self) -> None:
        queued, running = self.driver.level()
        self.timeline.sample(queued, running, self.pcfg.capacity * len(self.table.serving()))

    def has_news(self) -> bool:
        news = not self.driver.events.empty() or self.driver.slot_freed.is_set()
        return news or self.outbox.has_mail() or self.writer.has_news()

    # ----- the end -----
    def stop_watching(self) -> None:
        """Before the cells are told to shut down: from then on a closed liveness connection is no death."""
        if self.table.liveness is not None:
            self.table.liveness.close()

    def finish(self, wall_s: float, stopped: str = "") -> None:
        self.stop_watching()
        self.driver.close()
        self.writer.close()
        self.proxy.stop()
        alive = [c.rank for c in self.table.alive()]
        self.finalize = len(alive) == len(self.table.cells)
        self.cp.request(alive, Shutdown("run finished", self.finalize), timeout=self.cfg.sched.cell_timeout_s)
        for rank in sorted(self.abandoned):  # declared dead but perhaps running: it would hold the job open
            try:
                self.cp.request([rank], Shutdown("declared dead", False), timeout=10.0)
            except ControlError:
                pass
        for c in self.table.cells:  # a dead cell's followers on other hosts cannot see their leader go
            for rank in c.remote_followers if not c.alive else ():
                self.cp.send(rank, Shutdown("its cell was declared dead", False))
        self.bar.close()
        title = f"{self.cfg.scheduler}: {len(self.step_rows)} steps, {wall_s:.0f} s"
        timeline = self.timeline.save(self.out, title, self.driver.slots)
        curve = plot_learning_curve(self.run_rows, self.out / "learning_curve.png", self.eval_rows)
        report = self.summary(wall_s) | {"stopped_by": stopped}
        (self.out / "summary.json").write_text(json.dumps(report, indent=1))
        self.metrics.write({"event": "summary", **report})
        self.metrics.image("timeline", timeline)
        self.metrics.image("learning_curve", curve)
        self.metrics.close()
        print(f"gyre: {self.cfg.scheduler} finished {len(self.step_rows)} steps in {wall_s:.1f} s")
        print(summary_line(self.run_rows, self.out, self.book.pool.skipped_causes(), self.eval_rows), flush=True)

    def summary(self, wall_s: float) -> dict[str, Any]:
        lat = self.switcher.latencies
        last = self.step_rows[-max(1, len(self.step_rows) // 4) :]
        return {
            "scheduler": self.cfg.scheduler,
            "steps": self.state.next_step,  # completed steps of the run, over every start
            "steps_this_start": len(self.step_rows),
            "starts": len(self.state.starts),
            "wall_s": round(wall_s, 3),
            "final_reward": statistics.fmean(r["reward_mean"] for r in last) if last else None,
            "final_success": statistics.fmean(r["success_rate"] for r in last) if last else None,
            "switches": {k: len(v) for k, v in lat.items()},
            "switch_median_s": {k: round(statistics.median(v), 4) for k, v in lat.items() if v},
            "continued_calls": self.proxy.dispatcher.continued,
            "continued_recomputed_tokens": self.proxy.dispatcher.continued_recomputed_tokens,
            **self.switcher.migrated,
            "dead_cells": [c.index for c in self.table.cells if not c.alive],
            "dead_cell_reasons": {str(k): v for k, v in sorted(self.dead_reasons.items())},
            "routed_around": self.proxy.dispatcher.routed_around,
            "engine_failures": dict(self.proxy.dispatcher.engine_failures),
            "faults": self.faults.log,
            "role_seconds": self.timeline.role_seconds(),
            "skipped_tasks": self.book.pool.skipped_causes(),
            "held_out_pass@1": {
                str(r["version"]): r["pass@1"] for r in self.eval_rows
            },  # by weight version  # the suite's tasks that could not be loaded
        }
