"""`mpirun -n W python -m mpi4py tests/reshard_job.py save|load DIR TP PP`: the Megatron trainer of
model_parallel_job over a W-rank gloo world with train.tensor_parallel=TP, pipeline_parallel=PP.

save: one optimizer update from model_parallel_job's weights, then the sharded checkpoint DIR/trainer;
load: the checkpoint DIR/trainer loaded into this layout. Rank 0 then writes `whole_state` (weights and
AdamW's state of the whole model, gathered) to DIR/<mode>.pt."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import model_parallel_job as job  # noqa: E402


def whole_state(trainer: Any) -> dict[str, Any]:
    """Weights, AdamW's exp_avg / exp_avg_sq (HF names, the whole model) and step counters, any layout."""
    from gyre.model.weights import megatron_to_hf
    from gyre.train.shard_weights import gather_shards

    named = [(n, p) for n, p in trainer.model.named_parameters()]
    out: dict[str, Any] = {"weights": trainer.hf_state_dict(), "step": trainer.step}
    for key in ("exp_avg", "exp_avg_sq"):
        local = {n: trainer.optimizer.state[p][key] for n, p in named}
        out[key] = megatron_to_hf(gather_shards(local, job.CFG), job.CFG)
    out["adam_steps"] = sorted({float(trainer.optimizer.state[p]["step"]) for _, p in named})
    return out


def main(mode: str, directory: Path, tp: int, pp: int) -> None:
    from mpi4py import MPI

    from gyre.comm.gloo_transport import init_gloo_from_mpi
    from gyre.train.megatron_gpt import parallel_state
    from gyre.train.megatron_trainer import MegatronTrainer

    init_gloo_from_mpi(MPI.COMM_WORLD)
    trainer = MegatronTrainer(job.CFG, job.train_config(tp, pp))
    if mode == "save":
        trainer.load_hf_state_dict(job.initial_weights())
        dp, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        job.one_step(trainer, job.micro_batches()[dp::dp_size])
        trainer.save(directory / "trainer")
    else:
        trainer.load(directory / "trainer")
    state = whole_state(trainer)
    if MPI.COMM_WORLD.Get_rank() == 0:
        torch.save(state, directory / f"{mode}.pt")
    MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
