"""`mpirun -n 4 python -m mpi4py tests/sched_reduce_job.py OUT`: ranks 1-3 send flat gradients to rank 0
(gyre.sched.cell.grad_reduce), rank 3 a second late; rank 0 checks the sum and how much CPU its wait took."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from gyre.comm.control import world_control_plane
from gyre.sched.cell.grad_reduce import receive_gradients, send_gradients

NUMEL, N_PARAMS = 100_003, 4


def main(out: Path) -> None:
    cp = world_control_plane([1, 1, 1])
    rank = cp.rank
    masks = {1: [1, 0, 0, 0], 2: [0, 1, 0, 1], 3: [1, 0, 0, 0]}
    values = {r: torch.arange(NUMEL, dtype=torch.float32) * r + 0.25 for r in masks}
    if rank == 0:
        wall, cpu = time.monotonic(), time.process_time()
        total, has = receive_gradients(cp, [1, 2, 3], NUMEL, N_PARAMS, 60.0)
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
        want = sum(values.values())
        out.write_text(
            json.dumps(
                {
                    "max_abs_diff": float((total - want).abs().max()),
                    "mask": has.tolist(),
                    "idle_cpu_fraction": cpu / wall,
                }
            )
        )
    else:
        if rank == 3:
            time.sleep(1.0)
        has = torch.tensor(masks[rank], dtype=torch.uint8)
        send_gradients(cp, 0, values[rank], has, 60.0)
    cp.comm.Barrier()
    cp.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
