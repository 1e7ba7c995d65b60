"""What the controller and a cell run, over any control plane (MPI ranks, or threads of one process).

The controller (`run_controller`) picks the starting point, builds or reuses the warm start and writes where
the cells start from (RUN_DIR/policy.json), then drives the run (gyre.sched.controller.orchestrator). A cell
(`run_cell`) starts its engine and builds its training replica from that, then serves the controller
(gyre.sched.cell.worker); a cell's other ranks follow its first (`run_follower`, MPI only).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre.comm.control import ControlPlane
from gyre.config.schema import CellResources, ModelConfig, RunConfig
from gyre.errors import UserError

if TYPE_CHECKING:  # the cell imports it once it runs
    from gyre.sched.cell.engine import CellEngine

POLICY_FILE = "policy.json"  # the warm start the cells load, written by the controller


@dataclass(frozen=True)
class RunStart:
    """One start of a run as the controller and every cell see it: its config, its directory, this start's id
    (a policy.json an earlier start of the same directory left is not this one's), and whether the run is one
    cell in the controller's process (gyre.sched.launch.in_process) rather than an MPI job of cells."""

    cfg: RunConfig
    out: Path
    start_id: str
    in_process: bool = False


def run_controller(start: RunStart, cp: ControlPlane, point: Any = None) -> bool:
    """Pick the starting point (a checkpoint to resume, outputs of unfinished steps moved aside; `point`, a
    ResumePoint, given: that one, nothing moved), tell the cells through policy.json, run; returns whether
    the cells may MPI_Finalize. A stop signal checkpoints and raises Preempted."""
    from gyre.resume.recovery import prepare_resume
    from gyre.sched.controller.orchestrator import Controller, StopRequest

    cfg, out = start.cfg, start.out
    stop = StopRequest(start.in_process)  # a stop from here on is a checkpoint at the last completed step
    point = point or prepare_resume(out, cfg.resume, log=print)
    master = start_kv_store_master(cfg, out)
    try:
        tokenizer_dir = write_policy(start, point.checkpoint, point.state.next_step, master.address if master else "")
        controller = Controller(start, cp, tokenizer_dir, point, stop)
        try:
            controller.run()
        except BaseException:
            controller.abandon()
            raise
        finally:
            controller.stop_engines_of_lost_cells()
    finally:
        if master is not None:
            master.stop()
    return controller.finalize


def start_kv_store_master(cfg: RunConfig, out: Path) -> Any:
    """The Mooncake store's master that the engines' HiCache shares (gyre.engine.hicache), on this node, for the
    run's lifetime; None when engine.hicache_storage_backend is not mooncake or its extra config names one."""
    from gyre.engine.hicache import needs_master, start_master

    if not needs_master(cfg.engine):
        return None
    from gyre.comm.mooncake_transport import resolve_hostname

    return start_master(resolve_hostname(cfg.comm.hostname), out / "mooncake_master.log")


def write_policy(start: RunStart, resume_from: Path | None, version: int, kv_store_master: str = "") -> Path:
    """The controller finds or builds the warm start while the cells start up, and writes where the cells
    start from (the warm start, and the run's checkpoint when resuming) and the address of the KV store's
    master it started ("": none); returns the tokenizer dir."""
    from gyre.harness.preflight import check_harness_fits
    from gyre.tasks.suite import TaskPool
    from gyre.warm_start import prepare_policy

    cfg, out, start_id = start.cfg, start.out, start.start_id
    first = TaskPool(cfg.tasks.families, cfg.tasks.pool_size, seed=cfg.seed).for_step(0, cfg.rl.groups_per_step)
    policy = prepare_policy(cfg, log=print, check=lambda tok: check_harness_fits(cfg, first, tok))
    check_vocab_splits(policy.model_cfg.vocab_size, cfg.train.tensor_parallel)
    paths = {"start_id": start_id, "model": asdict(policy.model_cfg), "tokenizer_dir": str(policy.tokenizer_dir)}
    paths |= {"checkpoint_dir": str(policy.checkpoint_dir), "resume_from": str(resume_from or ""), "version": version}
    paths["kv_store_master"] = kv_store_master
    tmp = out / f"{POLICY_FILE}.tmp"
    tmp.write_text(json.dumps(paths, indent=1))
    tmp.rename(out / POLICY_FILE)
    return policy.tokenizer_dir


def check_vocab_splits(vocab_size: int, tensor_parallel: int) -> None:
    """Megatron splits the vocabulary over tensor-parallel ranks; a trained tokenizer's size is what its corpus
    gave (at most tokenizer.vocab_size), so the config check cannot see this before the warm start exists."""
    if vocab_size % tensor_parallel:
        raise UserError(
            f"train.tensor_parallel={tensor_parallel}: the warm start's tokenizer has {vocab_size} tokens, which "
            f"{tensor_parallel} ranks cannot split evenly (a padded vocabulary is not implemented); use another "
            "tokenizer.vocab_size or train.tensor_parallel=1"
        )


def policy_paths(out: Path, cp: ControlPlane, start_id: str) -> dict[str, Any]:
    """What the controller wrote for this start (building a warm start takes minutes; if it fails, the
    controller's error ends the job, and a controller in this process tells the cell to stop: that ends the
    wait at once). A policy.json of an earlier start (a requeued job) is not this one."""
    path = out / POLICY_FILE

    def written() -> dict[str, Any] | None:
        try:
            paths = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return paths if paths.get("start_id") == start_id else None

    def written_or_stopped() -> dict[str, Any] | None:
        paths = written()
        if paths is None and cp.has_mail():
            paths = written()  # the controller writes it before it sends anything: mail without it is a stop
            if paths is None:
                env = cp.recv(timeout=0)
                raise RuntimeError(f"the controller stopped before writing {POLICY_FILE} ({env and env.body})")
        return paths

    paths = cp.wait_for(written_or_stopped, None)
    return {
        "model_cfg": ModelConfig(**paths["model"]),
        "ckpt": Path(paths["checkpoint_dir"]),
        "tok": Path(paths["tokenizer_dir"]),
        "resume_from": Path(paths["resume_from"]) if paths["resume_from"] else None,
        "version": int(paths["version"]),
        "kv_store_master": paths.get("kv_store_master", ""),
    }


def cell_resources(cfg: RunConfig, cell: int) -> CellResources:
    """Cell 0 is cluster.core, cell i satellite i-1 (local runs may have more cells than listed: the last)."""
    sats = cfg.cluster.satellites
    if cell == 0 or not sats:
        return cfg.cluster.core
    return sats[min(cell, len(sats)) - 1]


def run_cell(start: RunStart, cp: ControlPlane) -> bool:
    """Import megatron and build the training replica in a thread while the engine starts in this one, then
    serve the controller. In one process (start.in_process): the run's only cell, in the controller's process,
    with torch's threads as they are and the engine's own (engine.num_threads) rather than
    sched.threads_per_cell (and its engine as start_cell_engine says)."""
    cfg, out, in_process = start.cfg, start.out, start.in_process
    if cp.cell_comm.Get_size() > 1:  # the cell's trainer world over its ranks (gloo; NCCL on GPUs), for megatron
        from gyre.sched.cell.world import init_trainer_world

        init_trainer_world(cp.cell_comm, cfg.comm.hostname)
    if cp.cell_comm.Get_rank() > 0:
        return run_follower(start, cp)
    got: dict[str, Any] = {}
    have_paths = threading.Event()
    threads = cfg.engine.num_threads if in_process else cfg.sched.threads_per_cell

    def build() -> None:
        from gyre.sched.cell.worker import build_replica  # torch, megatron: seconds
        from gyre.warm_start import Policy

        have_paths.wait()
        if "model_cfg" not in got:  # no policy: the controller stopped first (policy_paths raised)
            return
        got["policy"] = Policy(got["model_cfg"], got["tok"], got["ckpt"])
        got["trainer"] = build_replica(cfg, got["policy"], got["resume_from"], None if in_process else threads)

    builder = threading.Thread(target=build, name="gyre-replica", daemon=True)
    builder.start()
    try:
        got.update(policy_paths(out, cp, start.start_id))
    finally:
        have_paths.set()
    engine = start_cell_engine(start, cp.cell, got, threads)
    builder.join()
    if "trainer" not in got:
        engine.stop()
        raise RuntimeError(f"cell {cp.cell}: building the training replica failed (its error is printed above)")
    from gyre.sched.cell.worker import CellParts, CellWorker

    return CellWorker(cfg, cp, CellParts(got["policy"], engine, got["trainer"], got["version"])).serve()


def start_cell_engine(start: RunStart, cell: int, paths: dict[str, Any], threads: int) -> CellEngine:
    """The cell's engine on the warm start's weights (`paths`: policy_paths'). In one process, the run's only
    engine: no Mooncake (its keys/values never move), its synced weights kept in RUN_DIR/weights."""
    from gyre.comm.mooncake_transport import resolve_hostname
    from gyre.engine.engine import EngineSetup
    from gyre.sched.cell.engine import CellEngine, cell_env, cell_nodes, cell_scratch

    cfg, out = start.cfg, start.out
    setup = EngineSetup(
        paths["model_cfg"],
        paths["tok"],
        log_dir=out / "cells" / f"cell{cell}",
        scratch=out / "weights" if start.in_process else cell_scratch(),
        env=cell_env(cfg.comm.hostname, cfg.cluster.mooncake.protocol, threads),
        nodes=cell_nodes(cell, os.environ) if cfg.engine.backend == "sglang" else [],
        gpus_per_node=cell_resources(cfg, cell).gpus_per_node,
        trainer_address=resolve_hostname(cfg.comm.hostname),
        routed_experts=cfg.rl.routing_replay,
    )
    engine_cfg = dataclasses.replace(cfg.engine, num_threads=threads)
    if paths.get("kv_store_master"):  # the Mooncake store's master the controller started (gyre.engine.hicache)
        from gyre.engine.hicache import with_master

        engine_cfg = with_master(engine_cfg, paths["kv_store_master"])
    return CellEngine(engine_cfg, setup, paths["ckpt"], kv_transfer=not start.in_process, keep_scratch=start.in_process)


def run_follower(start: RunStart, cp: ControlPlane) -> bool:
    """A cell rank after its first: its shard of the replica, run as the cell's leader tells it."""
    from gyre.sched.cell.ranks import CellFollower
    from gyre.sched.cell.worker import build_replica
    from gyre.warm_start import Policy

    cfg = start.cfg
    paths = policy_paths(start.out, cp, start.start_id)
    policy = Policy(paths["model_cfg"], paths["tok"], paths["ckpt"])
    threads = cfg.sched.threads_per_cell
    return CellFollower(cfg, cp, build_replica(cfg, policy, paths["resume_from"], threads)).serve()
