"""`mpirun -n 5 python -m mpi4py tests/cell_reduce_job.py OUT TP PP`: the cell runtime's layout of a
controller (rank 0) and two cells of two ranks (1-2 the core, 3-4 a satellite), each cell one Megatron
world (gloo over its communicator) with train.tensor_parallel=TP, pipeline_parallel=PP. Cell c trains
micro-batches c, c + 2 of tests/model_parallel_job.py's step; the gradients reduce to the core shard to
shard (gyre.sched.cell_group.reduce_shard), which steps. The core's leader writes what
model_parallel_job writes."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import model_parallel_job as job  # noqa: E402


def main(out: Path, tp: int, pp: int) -> None:
    from gyre.comm.control import world_control_plane
    from gyre.comm.gloo_transport import init_gloo_from_mpi
    from gyre.comm.messages import GradientReduce
    from gyre.sched.cell_group import reduce_shard
    from gyre.train.megatron_trainer import MegatronTrainer

    cp = world_control_plane([tp * pp, tp * pp])
    if cp.is_controller:
        cp.comm.Barrier()
        cp.close()
        return
    init_gloo_from_mpi(cp.cell_comm)
    trainer = MegatronTrainer(job.CFG, job.train_config(tp, pp))
    trainer.load_hf_state_dict(job.initial_weights())
    batches = job.micro_batches()
    trainer.zero_grad()
    trainer.forward_backward(batches[cp.cell :: 2], job.loss_fn)
    leaders = cp.layout.leaders
    metrics = reduce_shard(cp, trainer, GradientReduce(0, leaders[0], leaders, 1.0, "1"), 120.0)
    if cp.cell == 0:
        weights = trainer.hf_state_dict()
        if cp.cell_comm.Get_rank() == 0:
            layout = {"tp": tp, "pp": pp, "dp": 2}
            torch.save({"weights": weights, "metrics": metrics, "layout": layout}, out)
    cp.comm.Barrier()
    cp.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
