"""`mpirun -n 5 python -m mpi4py tests/cell_reduce_job.py OUT TP PP`: the cell runtime's layout of a
controller (rank 0) and two cells of two ranks (1-2 the core, 3-4 a satellite), each cell one Megatron
world (gloo over its communicator) with train.tensor_parallel=TP, pipeline_parallel=PP. Cell c trains
micro-batches c, c + 2 of tests/model_parallel_job.py's step; the gradients reduce to the core shard to
shard (gyre.sched.cell.ranks.reduce_shard), which steps. Then the satellite takes the new weights as the
cell runtime does: each core rank publishes its shard through Mooncake and satellite rank i pulls core rank
i's (gyre.sched.cell.ranks.local_shard / load_local_shard). The core's leader writes what
model_parallel_job writes, the satellite's whole weights after the pull, the bytes each satellite rank
pulled and the size of the whole model (what every satellite rank received before shard pulls)."""

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
    from gyre.comm.transfer import ShardHandles, WeightTransport, make_transport
    from gyre.config.schema import CommConfig
    from gyre.sched.cell.ranks import load_local_shard, local_shard, reduce_shard
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
    index = cp.cell_comm.Get_rank()
    transport = WeightTransport(make_transport(CommConfig(hostname="127.0.0.1")))
    if cp.cell == 0:  # each core rank publishes its shard; the leader hands the handles to the satellite's
        handles = cp.cell_comm.gather(transport.publish(local_shard(trainer), "1"), root=0)
        if index == 0:
            cp.comm.send(ShardHandles(tuple(handles)), dest=leaders[1])
    else:
        handles = cp.cell_comm.bcast(cp.comm.recv(source=leaders[0]) if index == 0 else None, root=0)
        load_local_shard(trainer, transport.pull(handles.shards[index]).state)
    weights = trainer.hf_state_dict()  # each cell's whole weights, gathered from its shards
    pulled = cp.cell_comm.gather(handles.shards[index].nbytes if cp.cell == 1 else 0, root=0)
    if cp.cell == 1 and index == 0:
        cp.comm.send((weights, pulled), dest=leaders[0])
    if cp.cell == 0 and index == 0:
        satellite, pulled = cp.comm.recv(source=leaders[1])
        whole = sum(t.numel() * t.element_size() for t in weights.values())
        layout = {"tp": tp, "pp": pp, "dp": 2}
        torch.save({"weights": weights, "metrics": metrics, "layout": layout, "satellite_weights": satellite,
                    "pulled_bytes": pulled, "whole_bytes": whole}, out)  # fmt: skip
    cp.comm.Barrier()  # the satellite has pulled: the core's buffers may go
    transport.transport.close()
    cp.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
