"""`mpirun -n 2 python -m mpi4py tests/hf_dir_job.py HF_DIR OUT_DIR`: an HF directory (transformers'
save_pretrained) loaded into a train.tensor_parallel=2 Megatron trainer; its logits on TOKENS, one
optimizer step, the logits again, and the whole model written back in HF names to OUT_DIR/checkpoint.
Rank 0 writes the logits to OUT_DIR/logits.pt."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from gyre.config.schema import TrainConfig

TOKENS = torch.tensor([[1, 7, 22, 5, 63, 40, 9, 3, 17, 28, 44, 2], [5, 5, 11, 60, 0, 31, 8, 19, 21, 4, 50, 33]])


def nll(logp: torch.Tensor, mb: object) -> tuple[torch.Tensor, dict[str, float]]:
    loss = -logp.mean()
    return loss, {"nll": float(loss.detach())}


def main(hf_dir: Path, out: Path) -> None:
    from mpi4py import MPI

    from gyre.comm.gloo_transport import init_gloo_from_mpi
    from gyre.model.hf_io import load_hf_state, save_hf_checkpoint
    from gyre.train.megatron_trainer import MegatronTrainer, PaddedBatch

    init_gloo_from_mpi(MPI.COMM_WORLD)
    model_cfg, state = load_hf_state(hf_dir)
    trainer = MegatronTrainer(model_cfg, TrainConfig(lr=1e-2, num_threads=1, tensor_parallel=2))
    trainer.load_hf_state_dict(state)
    with torch.no_grad():
        before = trainer.logits(TOKENS)
    trainer.train_step([PaddedBatch(TOKENS)], nll)
    with torch.no_grad():
        after = trainer.logits(TOKENS)
    weights = trainer.hf_state_dict()  # every rank takes part in the gather
    if MPI.COMM_WORLD.Get_rank() == 0:
        save_hf_checkpoint(out / "checkpoint", weights, model_cfg)
        torch.save({"before": before, "after": after}, out / "logits.pt")
    MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), Path(sys.argv[2]))
