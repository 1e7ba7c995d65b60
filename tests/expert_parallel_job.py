"""`mpirun -n 2 python -m mpi4py tests/expert_parallel_job.py OUT`: one optimizer update of the Megatron trainer on
qwen3-moe-tiny with train.expert_parallel=2 over a 2-rank gloo world, each rank holding 2 of the 4 experts of each
layer; both ranks train every micro-batch of tests/model_parallel_job.py's step, as a cell's ranks do. Rank 0
writes what model_parallel_job writes, and the world saves its sharded checkpoint to OUT's directory."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import model_parallel_job as job  # noqa: E402

from gyre.config.schema import TrainConfig  # noqa: E402
from gyre.model.random_model import SHAPES, random_hf_state  # noqa: E402

CFG = dataclasses.replace(SHAPES["qwen3-moe-tiny"], vocab_size=64)


def train_config(ep: int = 1) -> TrainConfig:
    return dataclasses.replace(job.train_config(), expert_parallel=ep)


def initial_weights() -> dict[str, torch.Tensor]:
    """Norms and the router away from their init, so that their gradients and the routing matter."""
    gen = torch.Generator().manual_seed(6)
    state = random_hf_state(CFG, seed=5)
    return {k: v + 0.1 * torch.randn(v.shape, generator=gen) if "norm" in k or "gate." in k else v
            for k, v in state.items()}  # fmt: skip


def main(out: Path) -> None:
    from mpi4py import MPI

    from gyre.comm.gloo_transport import init_gloo_from_mpi
    from gyre.train.megatron_gpt import parallel_state
    from gyre.train.megatron_trainer import MegatronTrainer

    init_gloo_from_mpi(MPI.COMM_WORLD)
    trainer = MegatronTrainer(CFG, train_config(2))
    trainer.load_hf_state_dict(initial_weights())
    local = [k for k in trainer.model.state_dict() if "local_experts" in k and k.endswith("weight")]
    batches = job.micro_batches()
    with torch.no_grad():
        before = trainer.micro_batch_logprobs(batches[1])
    metrics, grads = job.one_step(trainer, batches)
    after = trainer.hf_state_dict()
    trainer.save(out.parent / "trainer")
    if MPI.COMM_WORLD.Get_rank() == 0:
        layout = {"ep": parallel_state.get_expert_model_parallel_world_size(), "local_expert_weights": len(local)}
        torch.save({"weights": after, "grads": grads, "metrics": metrics, "logprobs": before, "layout": layout}, out)
    MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
