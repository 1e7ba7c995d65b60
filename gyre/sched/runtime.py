"""What the controller and a cell run, over any control plane (MPI ranks, or threads of one process).

The controller (`run_controller`) picks the starting point, builds or reuses the warm start and writes where
the cells start from (RUN_DIR/policy.json), then drives the run (gyre.sched.controller.orchestrator). A cell
(`run_cell`) starts its engine and builds its training replica from that, then serves the controller
(gyre.sched.cell.worker); a cell's other ranks follow its first (`run_follower`, MPI only).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gyre.comm.control import ControlPlane
from gyre.config.schema import CellResources, ModelConfig, RunConfig
from gyre.errors import UserError

POLICY_FILE = "policy.json"  # the warm start the cells load, written by the controller


def run_controller(
    cfg: RunConfig, cp: ControlPlane, out: Path, start_id: str, in_process: bool = False, point: Any = None
) -> bool:
    """Pick the starting point (a checkpoint to resume, outputs of unfinished steps moved aside; `point`, a
    ResumePoint, given: that one, nothing moved), tell the cells through policy.json, run; returns whether
    the cells may MPI_Finalize. A stop signal checkpoints and raises Preempted."""
    from gyre.resume.recovery import prepare_resume
    from gyre.sched.controller.orchestrator import Controller, StopRequest

    stop = StopRequest(in_process)  # a stop from here on is a checkpoint at the last completed step
    point = point or prepare_resume(out, cfg.resume, log=print)
    tokenizer_dir = write_policy(cfg, out, start_id, point.checkpoint, point.state.next_step)
    controller = Controller(cfg, cp, tokenizer_dir, out, point, stop)
    try:
        controller.run()
    except BaseException:
        controller.abandon()
        raise
    finally:
        controller.stop_engines_of_lost_cells()
    return controller.finalize


def write_policy(cfg: RunConfig, out: Path, start_id: str, resume_from: Path | None, version: int) -> Path:
    """The controller finds or builds the warm start while the cells start up, and writes where the cells
    start from (the warm start, and the run's checkpoint when resuming); returns the tokenizer dir."""
    from gyre.harness.preflight import check_harness_fits
    from gyre.tasks.suite import TaskPool
    from gyre.warm_start import prepare_policy

    first = TaskPool(cfg.tasks.families, cfg.tasks.pool_size, seed=cfg.seed).for_step(0, cfg.rl.groups_per_step)
    policy = prepare_policy(cfg, log=print, check=lambda tok: check_harness_fits(cfg, first, tok))
    check_vocab_splits(policy.model_cfg.vocab_size, cfg.train.tensor_parallel)
    paths = {"start_id": start_id, "model": asdict(policy.model_cfg), "tokenizer_dir": str(policy.tokenizer_dir)}
    paths |= {"checkpoint_dir": str(policy.checkpoint_dir), "resume_from": str(resume_from or ""), "version": version}
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
    controller's error ends the job). A policy.json of an earlier start (a requeued job) is not this one."""
    path = out / POLICY_FILE

    def written() -> dict[str, Any] | None:
        try:
            paths = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return paths if paths.get("start_id") == start_id else None

    paths = cp.wait_for(written, None)
    return {
        "model_cfg": ModelConfig(**paths["model"]),
        "ckpt": Path(paths["checkpoint_dir"]),
        "tok": Path(paths["tokenizer_dir"]),
        "resume_from": Path(paths["resume_from"]) if paths["resume_from"] else None,
        "version": int(paths["version"]),
    }


def cell_resources(cfg: RunConfig, cell: int) -> CellResources:
    """Cell 0 is cluster.core, cell i satellite i-1 (local runs may have more cells than listed: the last)."""
    sats = cfg.cluster.satellites
    if cell == 0 or not sats:
        return cfg.cluster.core
    return sats[min(cell, len(sats)) - 1]


def run_cell(cfg: RunConfig, cp: ControlPlane, out: Path, start_id: str, in_process: bool = False) -> bool:
    """Import megatron and build the training replica in a thread while the engine starts in this one (the
    thread it starts on owns it: see gyre.sched.cell.engine), then serve the controller. `in_process`: the
    run's only cell, in the controller's process, with torch's threads as they are and the engine's own
    (engine.num_threads) rather than sched.threads_per_cell, no Mooncake (nothing to send anywhere), and the
    engine's synced weights kept in RUN_DIR/weights."""
    from gyre.comm.mooncake_transport import resolve_hostname
    from gyre.sched.cell.engine import CellEngine, cell_env, cell_nodes

    if cp.cell_comm.Get_size() > 1:  # the cell's trainer world over its ranks (gloo; NCCL on GPUs), for megatron
        from gyre.sched.cell.world import init_trainer_world

        init_trainer_world(cp.cell_comm, cfg.comm.hostname)
    if cp.cell_comm.Get_rank() > 0:
        return run_follower(cfg, cp, out, start_id)
    got: dict[str, Any] = {}
    have_paths = threading.Event()
    threads = cfg.engine.num_threads if in_process else cfg.sched.threads_per_cell

    def build() -> None:
        from gyre.sched.cell.worker import build_replica  # torch, megatron: seconds
        from gyre.warm_start import Policy

        have_paths.wait()
        got["policy"] = Policy(got["model_cfg"], got["tok"], got["ckpt"])
        got["trainer"] = build_replica(cfg, got["policy"], got["resume_from"], None if in_process else threads)

    builder = threading.Thread(target=build, name="gyre-replica", daemon=True)
    builder.start()
    try:
        got.update(policy_paths(out, cp, start_id))
    finally:
        have_paths.set()
    env = cell_env(cfg.comm.hostname, cfg.cluster.mooncake.protocol, threads)
    resources = cell_resources(cfg, cp.cell)
    nodes = cell_nodes(cp.cell, os.environ) if cfg.engine.backend == "sglang" else []
    engine = CellEngine(
        cfg.engine, got["model_cfg"], got["ckpt"], got["tok"], out / "cells" / f"cell{cp.cell}", threads, env,
        nodes=nodes, gpus_per_node=resources.gpus_per_node, trainer_address=resolve_hostname(cfg.comm.hostname),
        kv_transfer=not in_process, scratch=out / "weights" if in_process else None,
    )  # fmt: skip
    builder.join()
    if "trainer" not in got:
        engine.stop()
        raise RuntimeError(f"cell {cp.cell}: building the training replica failed (its error is printed above)")
    from gyre.sched.cell.worker import CellWorker

    return CellWorker(cfg, cp, got["policy"], engine, got["trainer"], got["version"]).serve()


def run_follower(cfg: RunConfig, cp: ControlPlane, out: Path, start_id: str) -> bool:
    """A cell rank after its first: its shard of the replica, run as the cell's leader tells it."""
    from gyre.sched.cell.ranks import CellFollower
    from gyre.sched.cell.worker import build_replica
    from gyre.warm_start import Policy

    paths = policy_paths(out, cp, start_id)
    policy = Policy(paths["model_cfg"], paths["tok"], paths["ckpt"])
    threads = cfg.sched.threads_per_cell
    return CellFollower(cfg, cp, build_replica(cfg, policy, paths["resume_from"], threads)).serve()
