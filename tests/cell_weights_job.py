"""`mpirun -n 3 python -m mpi4py tests/cell_weights_job.py HF_DIR URL OUT TP PP`: a cell of two ranks sends its
weights to an SGLang server shard to shard, as the cell runtime does. Rank 0 is the controller (idle); ranks
1-2 are one cell, a Megatron world over its communicator (gyre.sched.cell.world.init_trainer_world: gloo on
CPU) with train.tensor_parallel=TP, pipeline_parallel=PP, holding the HF directory's weights. The leader drives
its follower over the cell's control plane (CellGroup; the follower serves in CellFollower.serve): push_stages
opens the server's weight-update session, each rank sends its stage (StageSender), and the server's version is
checked; twice, the second time with other weights over the groups the first opened. The leader then writes,
to OUT, the cell's whole HF state (gathered from both ranks), the tensors each rank sent, the engine's version,
and the server's own record of what it received (its /gyre_test/received)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

VERSIONS = ("1", "2")


def model_config():
    """Qwen3's tiny shape, untied (pipeline stages hold the embedding and the head apart), 4 layers."""
    from gyre.model.random_model import SHAPES

    return dataclasses.replace(SHAPES["qwen3-tiny"], tie_embeddings=False, num_layers=4)


def hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def run_config(tp: int, pp: int):
    from gyre.config.schema import CommConfig, EngineConfig, RunConfig, TrainConfig

    engine = EngineConfig(backend="sglang", tp_size=1, weight_sync="distributed")
    train = TrainConfig(num_threads=1, tensor_parallel=tp, pipeline_parallel=pp)
    return RunConfig(engine=engine, train=train, comm=CommConfig(hostname="127.0.0.1"))


def lead(cfg, cp, trainer, url: str, hf: dict[str, torch.Tensor], out: Path) -> None:
    from gyre.engine.client import SyncEngineClient
    from gyre.engine.engine import EngineServers, EngineSetup
    from gyre.engine.sglang_backend import SGLangEngine
    from gyre.sched.cell.ranks import CellGroup, StageSender, push_stages, sends_shard_to_shard

    group = CellGroup(cp, cfg.comm.hostname)
    engine = SGLangEngine(cfg.engine, EngineSetup(trainer.model_cfg, None, out.parent, out.parent / "scratch"))
    assert sends_shard_to_shard(engine, group.size)
    engine.servers = EngineServers([url])  # as SGLangEngine.start leaves it, with the server already up
    sender = StageSender(cfg, trainer)
    sent = [push_stages(group, sender, engine, VERSIONS[0])]
    group.tell("load", {k: 2 * v for k, v in hf.items()})  # other weights into every rank, then again
    trainer.load_hf_state_dict({k: 2 * v for k, v in hf.items()})
    sent.append(push_stages(group, sender, engine, VERSIONS[1]))
    group.tell("gather")
    whole = trainer.hf_state_dict()
    group.tell("shutdown", True)
    SyncEngineClient(url).post("/gyre_test/received", {"path": str(out.with_suffix(".received.pt"))})
    torch.save({"weights": whole, "sent": sent, "engine_version": engine.version, "groups": sorted(sender.groups)}, out)


def main(hf_dir: Path, url: str, out: Path, tp: int, pp: int) -> None:
    from gyre.comm.control import world_control_plane
    from gyre.sched.cell.ranks import CellFollower
    from gyre.sched.cell.world import init_trainer_world
    from gyre.train.megatron_trainer import MegatronTrainer

    cp = world_control_plane([2])
    if cp.is_controller:
        cp.comm.Barrier()
        cp.close()
        return
    init_trainer_world(cp.cell_comm, "127.0.0.1")
    cfg = run_config(tp, pp)
    trainer = MegatronTrainer(model_config(), cfg.train)
    hf = hf_weights(hf_dir)
    trainer.load_hf_state_dict(hf)
    if cp.cell_comm.Get_rank() == 0:
        lead(cfg, cp, trainer, url, hf, out)
    else:
        CellFollower(cfg, cp, trainer).serve()
    cp.comm.Barrier()
    cp.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
