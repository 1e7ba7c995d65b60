"""A cell of several ranks: its leader (the cell's first rank) serves the controller and runs the engine;
the other ranks hold the rest of the cell's Megatron shards and follow the leader.

Before each trainer operation that is collective over the cell's trainer world (a gather of the HF
weights, loading weights, training micro-batches, the gradient reduction, a checkpoint) the leader
tells its followers, over the cell's MPI communicator, which one and with what; each follower runs
the same call on its own shard. Waits are probes with a sleep (gyre.comm.control's rule), never spins.

Across cells the gradients reduce shard to shard: rank i of a satellite sends its shard's gradients to
rank i of the core (every cell has the same layout).

New weights reach a satellite of several ranks shard by shard: each rank of the core publishes its own
shard through the weight transport (Mooncake) and rank i of the satellite pulls rank i's, which is exactly
the part it holds (every cell has the same layout); nothing goes through the leader.

New weights reach a cell's SGLang servers shard to shard too (engine.weight_sync=distributed): the leader
opens each server's weight-update session and tells its followers to send; every rank all-gathers its
stage's tensor-parallel shards and the first tensor-parallel rank of each pipeline stage broadcasts its
stage, in HF names, to each server over a group of its own (`push_stages`, `StageSender`).

A cell's ranks may sit on several nodes. A follower on its leader's host watches the leader's process; one
on another host cannot, and waits for the controller instead, which tells the followers of a cell it has
declared dead to leave (`Controller.finish`: a Shutdown over the world communicator, without MPI_Finalize).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gyre.comm.control import CONTROL_TAG, ControlPlane
from gyre.comm.messages import GradientReduce, Shutdown
from gyre.comm.transfer import BufferHandle, ShardHandles, WeightTransport, make_transport
from gyre.config.schema import RunConfig
from gyre.resume.checkpoint import TRAINER_FILE, BackgroundWriter, Snapshot
from gyre.resume.state import checkpoint_paths
from gyre.sched.replica import MicroBatchSource, core_step, flat_grads, grad_numel
from gyre.train.trainer import Trainer

if TYPE_CHECKING:
    from gyre.engine.sglang_backend import SGLangEngine

FOLLOW_TAG = 4545
_GONE = object()


class CellGroup:
    """The leader's side: tell every follower what to run next."""

    def __init__(self, cp: ControlPlane, address: str) -> None:
        self.cp = cp
        self.comm = cp.cell_comm
        self.size = self.comm.Get_size()
        self.comm.bcast((os.getpid(), socket.gethostname()), root=0)  # followers on this host watch it
        # where each of the cell's ranks runs, in cell order (the controller's cells.json lists them)
        self.ranks: list[dict[str, Any]] = self.comm.gather(rank_info(cp, address), root=0)

    def shard_handles(self, own: BufferHandle) -> ShardHandles:
        """Every rank's handle of its published shard, this one's first (the followers' `publish_shard`)."""
        return ShardHandles(tuple(self.comm.gather(own, root=0)))

    def tell(self, op: str, *args: Any) -> None:
        requests = [self.comm.isend((op, args), dest=r, tag=FOLLOW_TAG) for r in range(1, self.size)]
        for req in requests:
            self.cp.wait_for(lambda req=req: True if req.Test() else None, None)


def rank_info(cp: ControlPlane, address: str) -> dict[str, Any]:
    """Where a rank runs: its world rank, host, Slurm node and the address it advertises (its gloo pairs')."""
    node = os.environ.get("SLURMD_NODENAME", "")
    return {"rank": cp.rank, "host": socket.gethostname(), "slurm_node": node, "address": address}


def shard_ranks(cp: ControlPlane, leaders: tuple[int, ...] | list[int], index: int) -> list[int]:
    """The world ranks holding shard `index` of the cells whose leaders are given."""
    return [cp.layout.ranks(cp.layout.cell_of(r))[index] for r in leaders]


def local_shard(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The tensors this rank holds of the model (its megatron state_dict: its TP block of its PP stage)."""
    return {k: v.detach() for k, v in trainer.model.state_dict().items() if not k.endswith("._extra_state")}


def load_local_shard(trainer: Trainer, state: dict[str, torch.Tensor]) -> None:
    """Load a shard that the same rank of another cell of this layout published (see local_shard)."""
    result = trainer.model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
    if missing or result.unexpected_keys:
        raise KeyError(
            f"the pulled shard does not fit this rank: missing {missing}, unexpected {result.unexpected_keys}"
        )


def reduce_shard(cp: ControlPlane, trainer: Trainer, msg: GradientReduce, timeout: float) -> dict[str, Any] | None:
    """This rank's part of the step's gradient reduction: send its shard's gradients to the same shard of the
    core, or (on the core) sum the contributors' and step. Returns the step's metrics on the core, None elsewhere."""
    index = cp.cell_comm.Get_rank()
    [core_rank] = shard_ranks(cp, [msg.core_rank], index)
    contributors = shard_ranks(cp, msg.contributors, index)
    flat, has = flat_grads(trainer.model)
    if cp.rank != core_rank:
        from gyre.sched.cell.grad_reduce import send_gradients  # MPI: a cell alone in its process sends nothing

        send_gradients(cp, core_rank, flat, has, timeout)
        trainer.zero_grad()
        return None
    others = [r for r in contributors if r != cp.rank]
    if others:
        from gyre.sched.cell.grad_reduce import receive_gradients

        numel, n_params = grad_numel(trainer.model)
        total, any_has = receive_gradients(cp, others, numel, n_params, timeout)
        if cp.rank in contributors:
            total, any_has = total + flat, any_has | has
    else:
        total, any_has = (flat, has) if cp.rank in contributors else (torch.zeros_like(flat), torch.zeros_like(has))
    return core_step(trainer, total, any_has, msg.scale)


def sends_shard_to_shard(engine: Any, ranks: int) -> bool:
    """Whether a cell's ranks send their stages to its engine themselves (SGLang, engine.weight_sync=distributed,
    more than one rank) rather than its leader the whole model (the embedded engine, disk and tensor updates)."""
    from gyre.config.schema import resolved_weight_sync

    return ranks > 1 and engine.backend == "sglang" and resolved_weight_sync(engine.cfg) == "distributed"


class StageSender:
    """One rank's side of a shard-to-shard update of the cell's SGLang servers; its broadcast groups with them
    are opened at the first update and kept for the next, until the servers are started again."""

    def __init__(self, cfg: RunConfig, trainer: Trainer) -> None:
        self.cfg, self.trainer = cfg, trainer
        self.groups: dict[str, Any] = {}
        self.engine_pid = -1  # the servers' (their first process's) the groups were opened with

    def send(self, urls: list[str], version: str, engine_pid: int) -> int:
        """This rank's stage to every server (collective over the cell's ranks); the tensors it sent each.
        A restarted engine (another pid) has left the groups: new ones are opened."""
        if engine_pid != self.engine_pid:
            self.groups, self.engine_pid = {}, engine_pid
        from gyre.comm.mooncake_transport import resolve_hostname
        from gyre.engine.client import SyncEngineClient
        from gyre.engine.sglang_backend import send_stage
        from gyre.sched.cell.world import weight_group_backend

        clients = [SyncEngineClient(u) for u in urls]
        address = resolve_hostname(self.cfg.comm.hostname)  # this rank's: the groups' rendezvous is its own
        return send_stage(self.trainer.model, self.trainer.model_cfg, clients, version, address,
                          self.cfg.engine.tp_size, self.groups, weight_group_backend())  # fmt: skip


def push_stages(group: CellGroup, sender: StageSender, engine: SGLangEngine, version: str) -> list[int]:
    """The leader's side: every server's weight-update session opened, every rank of the cell sending its
    stage (the followers told to), the session closed once all have sent, then every server's version
    checked. Returns the tensors each rank sent each server, in cell order."""
    from gyre.engine.sglang_backend import weight_update_session

    servers = engine.servers
    with weight_update_session(servers.clients):
        group.tell("send_stage", servers.urls, version, engine.pid)
        sent = group.comm.gather(sender.send(servers.urls, version, engine.pid), root=0)
    servers.check_version(version)
    engine.version = version
    return sent


class CellFollower:
    """A follower rank: runs what its leader tells it on its shard of the cell's trainer, until shutdown."""

    def __init__(self, cfg: RunConfig, cp: ControlPlane, trainer: Trainer) -> None:
        self.cfg, self.cp, self.trainer = cfg, cp, trainer
        self.batches = MicroBatchSource(cfg)
        self.leader_pid, leader_host = cp.cell_comm.bcast(None, root=0)
        self.leader_here = leader_host == socket.gethostname()
        cp.cell_comm.gather(rank_info(cp, cfg.comm.hostname), root=0)
        self._weights: WeightTransport | None = None  # made on first use: its Mooncake engine, at this rank's address
        self.writer = BackgroundWriter()  # this rank's part of the core's checkpoints (snapshot)
        self.stages = StageSender(cfg, trainer)  # its part of new weights for the cell's SGLang servers

    @property
    def weights(self) -> WeightTransport:
        if self._weights is None:
            self._weights = WeightTransport(make_transport(self.cfg.comm, self.cfg.cluster.mooncake))
        return self._weights

    def serve(self) -> bool:
        """Returns whether to run MPI_Finalize (the leader's Shutdown says; not after the leader died, which
        the controller declares the whole cell dead for: the job then ends without MPI_Finalize)."""
        comm = self.cp.cell_comm
        while True:
            msg = self.cp.wait_for(lambda: comm.improbe(source=0, tag=FOLLOW_TAG) or self._leader_gone(), None)
            if msg is _GONE:
                return False
            op, args = msg.recv()
            if op == "shutdown":
                self.writer.close()
                if self._weights is not None:
                    self._weights.transport.close()
                return bool(args[0])
            getattr(self, op)(*args)

    def _leader_gone(self) -> object | None:
        """_GONE once the leader's process has exited (seen on its host) or the controller says the cell is dead
        (on another host, where the leader's process cannot be seen)."""
        if self.leader_here:
            try:
                os.kill(self.leader_pid, 0)
            except ProcessLookupError:
                return self._leave("its leader's process has exited")
        told = self.cp.comm.improbe(source=self.cp.layout.controller, tag=CONTROL_TAG)
        if told is not None and isinstance(told.recv().body, Shutdown):
            return self._leave("the controller declared the cell dead")
        return None

    def _leave(self, why: str) -> object:
        print(f"gyre: cell {self.cp.cell} rank {self.cp.cell_comm.Get_rank()}: {why}; leaving", flush=True)
        return _GONE

    def gather(self) -> None:
        self.trainer.hf_state_dict()

    def send_stage(self, urls: list[str], version: str, engine_pid: int) -> None:
        """This rank's stage to the cell's SGLang servers (push_stages), then tell the leader it is done."""
        self.cp.cell_comm.gather(self.stages.send(urls, version, engine_pid), root=0)

    def load(self, state: dict) -> None:
        self.trainer.load_hf_state_dict(state)

    def train(self, refs: list) -> None:
        self.trainer.forward_backward([self.batches.get(r) for r in refs], _loss_fn(self.cfg))

    def reduce(self, msg: GradientReduce) -> None:
        stepped = reduce_shard(self.cp, self.trainer, msg, self.cfg.sched.cell_timeout_s)
        self.batches = MicroBatchSource(self.cfg)
        if stepped is not None:  # the core publishes the new version shard by shard (CellGroup.shard_handles)
            self.cp.cell_comm.gather(self.weights.publish(local_shard(self.trainer), msg.version), root=0)

    def pull_shard(self, handles: ShardHandles) -> None:
        """This rank's shard of a new version, from the same rank of the core."""
        own = handles.shards[self.cp.cell_comm.Get_rank()]
        load_local_shard(self.trainer, self.weights.pull(own, reuse_buffer=True).state)

    def save(self, path: str) -> None:
        self.trainer.save(path)

    def snapshot(self) -> None:
        """The leader's snapshot (GroupCheckpoint.snapshot): copy this rank's shard now, write it in the background
        into the checkpoint the leader is writing (DCP's collectives order the two)."""
        snapshot = self.trainer.snapshot()
        assert snapshot is not None, "a cell's snapshot needs the sharded (CPU) checkpoint format"
        self.writer.submit(snapshot.write, checkpoint_paths(Path(self.cfg.output_dir))[2] / TRAINER_FILE)


def _loss_fn(cfg: RunConfig) -> Any:
    from gyre.pipeline import tree_gspo_loss_fn

    return tree_gspo_loss_fn(cfg.rl.clip_eps_low, cfg.rl.clip_eps_high, cfg.rl.mismatch)


class GroupCheckpoint:
    """The leader's trainer as the Checkpointer sees it: every rank of the cell writes its shard."""

    def __init__(self, group: CellGroup, trainer: Trainer) -> None:
        self.group, self.trainer = group, trainer

    def save(self, path: Any) -> None:
        self.group.tell("save", str(path))
        self.trainer.save(path)

    def snapshot(self) -> Snapshot | None:
        if not self.trainer.snapshots:
            return None
        self.group.tell("snapshot")  # its collectives (the snapshot's, then the write's) take every rank
        return self.trainer.snapshot()

    def load(self, path: Any) -> None:
        self.trainer.load(path)
