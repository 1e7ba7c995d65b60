"""A cell rank: one rollout engine and one training replica, switched between roles by the controller.

Cell 0 is the core: its replica holds the authoritative weights and the optimizer state, it sums the
others' gradients and steps, and it publishes each new version through the weight transport
(Mooncake by default). Satellites pull every version into their replica, so that a satellite joining
training mid-step needs no transfer. Every handler answers with an ack whose detail the controller
records (timings, engine URL, metrics).
"""

from __future__ import annotations

import os
import socket
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gyre.comm.control import ControlPlane
from gyre.comm.messages import (
    GradientReduce,
    Hello,
    MicroBatchAssignment,
    Role,
    RoleSwitch,
    SaveCheckpoint,
    Shutdown,
    WeightVersion,
)
from gyre.comm.mooncake_transport import resolve_hostname
from gyre.comm.transfer import BufferHandle, ShardHandles, WeightTransport, make_transport
from gyre.config.schema import RunConfig
from gyre.pipeline import tree_gspo_loss_fn
from gyre.resume.checkpoint import Checkpointer, load_checkpoint
from gyre.resume.state import RunState
from gyre.sched.cell.engine import CellEngine
from gyre.sched.cell.ranks import (
    CellGroup,
    GroupCheckpoint,
    StageSender,
    load_local_shard,
    local_shard,
    push_stages,
    reduce_shard,
    sends_shard_to_shard,
)
from gyre.sched.liveness import connect
from gyre.sched.replica import MicroBatchSource, grad_numel
from gyre.train.trainer import Trainer, make_trainer
from gyre.warm_start import Policy


def advertised_url(url: str, hostname: str) -> str:
    """The engine's URL as the controller reaches it: an engine bound to every interface (engine.host=0.0.0.0,
    as on a cluster, where the controller runs on another node) is advertised at this rank's address
    (comm.hostname; "auto": this host's IP)."""
    parts = urllib.parse.urlsplit(url)
    if parts.hostname not in ("0.0.0.0", "::"):
        return url
    return parts._replace(netloc=f"{resolve_hostname(hostname)}:{parts.port}").geturl()


def build_replica(
    cfg: RunConfig, policy: Policy, resume_from: Path | None = None, threads: int | None = None
) -> Trainer:
    """The cell's Megatron replica at the warm start, or at the run's checkpoint when resuming (every
    cell loads it: the core for its optimizer state, the satellites for the same weights). `threads`: torch's
    (None: as it is, a cell alone in its process)."""
    trainer = make_trainer(policy.model_cfg, cfg.train)
    if threads is not None:
        torch.set_num_threads(threads)
    trainer.load_hf_state_dict(policy.load_state())
    if resume_from is not None:
        load_checkpoint(resume_from, trainer, restore_random=False)
    return trainer


@dataclass(frozen=True)
class CellParts:
    """What a cell serves with: the warm start it began from, its engine, its training replica, and the weight
    version the replica holds (the checkpoint's when the run resumed; 0 at the warm start)."""

    policy: Policy
    engine: CellEngine
    trainer: Trainer
    version: int = 0


class CellWorker:
    def __init__(self, cfg: RunConfig, cp: ControlPlane, parts: CellParts) -> None:
        self.cfg, self.cp, self.policy, self.engine, self.trainer = cfg, cp, parts.policy, parts.engine, parts.trainer
        version = parts.version
        self.cell = cp.cell
        self.is_core = self.cell == 0
        self.role: Role = "rollout"
        self.version = str(version)
        self.group = CellGroup(
            cp, cfg.comm.hostname
        )  # the cell's other ranks, which follow this one (gyre.sched.cell.ranks)
        # engine.weight_sync=distributed on SGLang, several ranks: each rank sends its stage (gyre.sched.cell.ranks)
        self.stages = (
            StageSender(cfg, parts.trainer) if sends_shard_to_shard(parts.engine.engine, self.group.size) else None
        )
        if version:  # resumed: the engine started from the warm start serves the checkpoint's weights
            self.engine_update(self.version)()
        self._weights: WeightTransport | None = None  # made on first use: a cell alone publishes to nobody
        self.batches = MicroBatchSource(cfg)
        self.loss_fn = tree_gspo_loss_fn(cfg.rl.clip_eps_low, cfg.rl.clip_eps_high, cfg.rl.mismatch)
        self.timeout = cfg.sched.cell_timeout_s
        self.checkpointer = Checkpointer(Path(cfg.output_dir), cfg.checkpoint_async)  # used by the core only
        self.liveness: socket.socket | None = None  # open until this process ends: the controller sees it close

    @property
    def weights(self) -> WeightTransport:
        if self._weights is None:
            self._weights = WeightTransport(make_transport(self.cfg.comm, self.cfg.cluster.mooncake))
        return self._weights

    @property
    def alone(self) -> bool:
        """The run's only cell: nobody pulls its weights (scheduler=colocate on one cell)."""
        return len(self.cp.layout.cells) == 1 and self.group.size == 1

    def handlers(self) -> dict[type, Any]:
        return {
            Hello: self.hello,
            RoleSwitch: self.switch,
            WeightVersion: self.new_weights,
            MicroBatchAssignment: self.train,
            GradientReduce: self.reduce,
            SaveCheckpoint: self.save_checkpoint,
        }

    def serve(self) -> bool:
        """Answer the controller until it says stop; returns whether to run MPI_Finalize."""
        finalize = [True]

        def on_shutdown(msg: Shutdown) -> None:
            finalize[0] = msg.finalize
            self.group.tell("shutdown", msg.finalize)

        try:
            self.cp.serve({**self.handlers(), Shutdown: on_shutdown})
        finally:
            try:
                self.checkpointer.close()  # the checkpoint in flight is published before the job ends
            finally:
                self.engine.stop()
                if self._weights is not None:
                    self._weights.transport.close()
        return finalize[0]

    # ----- handlers -----
    def hello(self, msg: Hello) -> dict[str, Any]:
        liveness_error = ""
        if msg.liveness and self.liveness is None:
            try:
                self.liveness = connect(msg.liveness, self.cp.rank)
            except OSError as e:  # the run goes on; this cell's death is then seen only by sched.cell_timeout_s
                liveness_error = f"cannot connect to the controller's liveness watch at {msg.liveness}: {e}"
        return {
            "cell": self.cell,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "slurm_node": os.environ.get("SLURMD_NODENAME", ""),
            "address": self.cfg.comm.hostname,  # resolved on this node by the job's preflight
            "engine_url": advertised_url(self.engine.url, self.cfg.comm.hostname),
            "engine_pid": self.engine.pid,
            "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [],
            "ranks": self.group.ranks,  # the cell's ranks (world rank, host, Slurm node), its leader first
            "liveness_error": liveness_error,
        }

    def switch(self, msg: RoleSwitch) -> dict[str, Any]:
        start = time.monotonic()
        if msg.role == "train" and self.role == "rollout":
            if self.engine.alive():
                self.engine.leave_rollout()
        elif msg.role == "rollout" and self.role == "train" and self.engine.alive():
            stale = self.engine.version != self.version
            self.engine.resume(self.engine_update(self.version) if stale else None)
        elif msg.role == "rollout" and self.role == "train":  # its engine died while the cell trained
            self.engine.join_rollout(self.gather(), self.version)
        elif msg.role == "rollout" and not self.engine.alive():  # its engine died while serving: start another
            self.engine.join_rollout(self.gather(), self.version)
        self.role = msg.role
        url = advertised_url(self.engine.url, self.cfg.comm.hostname)
        return {"seconds": time.monotonic() - start, "engine_url": url, "engine_pid": self.engine.pid}

    def new_weights(self, msg: WeightVersion) -> dict[str, Any]:
        start = time.monotonic()
        handle = msg.handle
        pulled_bytes: list[int] = []  # per rank of this cell, through the weight transport
        if isinstance(handle, BufferHandle) and handle.transport == "gloo" and self.is_core:
            self.weights.serve(handle, msg.peers)
        elif not self.is_core and isinstance(handle, ShardHandles):  # each rank pulls its own shard from the core
            self.group.tell("pull_shard", handle)
            load_local_shard(self.trainer, self.weights.pull(handle.shards[0], reuse_buffer=True).state)
            pulled_bytes = [h.nbytes for h in handle.shards]
        elif not self.is_core:
            state = self.weights.pull(handle, reuse_buffer=True).state
            self.group.tell("load", state)  # the whole model to each follower, which keeps its shard
            self.trainer.load_hf_state_dict(state)
            pulled_bytes = [handle.nbytes]
        pulled = time.monotonic() - start
        self.version = msg.version
        if self.role == "rollout" and self.engine.alive():
            self.engine.load_while_serving(self.engine_update(msg.version))
        return {"pull_s": pulled, "pulled_bytes": pulled_bytes, "seconds": time.monotonic() - start}

    def save_checkpoint(self, msg: SaveCheckpoint) -> dict[str, Any]:
        if not self.is_core:
            raise RuntimeError(f"cell {self.cell} was asked to checkpoint; only the core holds the optimizer state")
        trainer = GroupCheckpoint(self.group, self.trainer)  # every rank of the cell writes its shard
        state = RunState.from_json(msg.state)
        if msg.final:
            self.checkpointer.save_final(state, trainer)
        else:
            self.checkpointer.save(state, trainer)  # a snapshot; written in the background
        return {"path": str(self.checkpointer.output_dir / "checkpoint"), "seconds": self.checkpointer.blocking_s}

    def train(self, msg: MicroBatchAssignment) -> dict[str, Any]:
        start = time.monotonic()
        self.group.tell("train", list(msg.refs))
        metrics = self.trainer.forward_backward([self.batches.get(r) for r in msg.refs], self.loss_fn)
        return {"micro_batches": list(msg.micro_batches), "metrics": metrics, "seconds": time.monotonic() - start}

    def reduce(self, msg: GradientReduce) -> dict[str, Any]:
        start = time.monotonic()
        self.group.tell("reduce", msg)
        metrics = reduce_shard(self.cp, self.trainer, msg, self.timeout)
        self.batches = MicroBatchSource(self.cfg)  # the step's shards are done with
        if metrics is None:
            return {"sent_bytes": grad_numel(self.trainer.model)[0] * 4, "seconds": time.monotonic() - start}
        if self.alone:
            handle: Any = None
        elif self.group.size > 1:  # each rank publishes its shard (its followers too): satellites pull shard to shard
            handle = self.group.shard_handles(self.weights.publish(local_shard(self.trainer), msg.version))
        else:
            handle = self.weights.publish(self.trainer.hf_state_dict(), msg.version)
        self.version = msg.version
        return {"handle": handle, "metrics": metrics, "seconds": time.monotonic() - start}

    def engine_update(self, version: str) -> Callable[[], None]:
        """What loads `version` into the serving engine: every rank's stage sent shard to shard (self.stages),
        or the whole model gathered now and loaded as engine.weight_sync says when called."""
        if self.stages is not None:
            stages = self.stages
            return lambda: push_stages(self.group, stages, self.engine.engine, version)  # type: ignore[arg-type]
        state = self.gather()
        return lambda: self.engine.load(state, version)

    def gather(self) -> dict[str, torch.Tensor]:
        """The whole model's HF weights, gathered from the cell's shards (its followers take part)."""
        self.group.tell("gather")
        return self.trainer.hf_state_dict()
