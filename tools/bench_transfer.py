"""Weight pull time, Mooncake Transfer Engine (TCP) vs torch.distributed gloo, side by side.

    python -m tools.bench_transfer [--repeats 7] [--big-mb 100]

Launches itself under the venv's `mpirun -n 2` (through `python -m mpi4py`, which aborts the job
when a rank raises instead of leaving the others waiting): rank 0 publishes each state dict on both
transports, rank 1 pulls it, alternating transports every repeat so both see the same machine load.
A pull is timed on the puller from the request to a usable state dict: transfer and version check,
and with a fresh receive buffer also its allocation and page faults (what a first pull pays; a
satellite pulling every step reuses its buffer). Payloads: the default tiny model
(gyre.config.schema.ModelConfig) and a synthetic fp32 state dict of about --big-mb MB. Prints medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def payloads(big_mb: int) -> dict[str, dict[str, torch.Tensor]]:
    from gyre.config.schema import ModelConfig
    from gyre.model.llama import LlamaForCausalLM

    torch.manual_seed(0)
    tiny = LlamaForCausalLM(ModelConfig()).state_dict()
    n = max(1, big_mb // 4)  # 4 MB tensors
    big = {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(n)}
    return {"tiny model (default config)": tiny, f"synthetic {big_mb} MB": big}


def worker(repeats: int, big_mb: int) -> None:
    from mpi4py import MPI

    from gyre.comm.gloo_transport import GlooTransport, init_gloo_from_mpi
    from gyre.comm.mooncake_transport import MooncakeTransport
    from gyre.comm.transfer import WeightTransport

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    init_gloo_from_mpi(comm)
    transports = {
        "mooncake": WeightTransport(MooncakeTransport(owner_rank=rank)),
        "gloo": WeightTransport(GlooTransport()),
    }
    rows = []
    for label, state in payloads(big_mb).items():
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        times: dict[tuple[str, bool], list[float]] = {(n, r): [] for r in (False, True) for n in transports}
        handles = comm.bcast(
            {name: t.publish(state, "bench-v1") for name, t in transports.items()} if rank == 0 else None, root=0
        )
        for i in range(repeats + 1):  # the first round warms connections up and is not counted
            for name, reuse in times:
                comm.Barrier()
                if rank == 0:
                    transports[name].serve(handles[name], [1])
                    continue
                start = time.perf_counter()
                pulled = transports[name].pull(handles[name], reuse_buffer=reuse)
                elapsed = time.perf_counter() - start
                if i == 0:
                    assert pulled.version == "bench-v1"
                    assert all(torch.equal(pulled.state[k], v) for k, v in state.items()), f"{name}: bytes differ"
                else:
                    times[name, reuse].append(elapsed)
        for reuse in (False, True) if rank == 1 else ():
            rows.append((label, reuse, nbytes, {n: statistics.median(times[n, reuse]) for n in transports}))
    if rank == 1:
        print(f"weight pull, median of {repeats} (loopback, {torch.get_num_threads()} torch thread)")
        head = f"{'payload':<30}{'receive buffer':>16}{'MB':>8}{'mooncake s':>12}{'GB/s':>7}{'gloo s':>10}{'GB/s':>7}"
        print(head + f"{'gloo/mooncake':>15}")
        for label, reuse, nbytes, med in rows:
            mc, gl = med["mooncake"], med["gloo"]
            print(
                f"{label:<30}{'reused' if reuse else 'fresh':>16}{nbytes / 1e6:>8.1f}{mc:>12.4f}"
                f"{nbytes / mc / 1e9:>7.2f}{gl:>10.4f}{nbytes / gl / 1e9:>7.2f}{gl / mc:>15.2f}"
            )
        sys.stdout.flush()
    comm.Barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--big-mb", type=int, default=100)
    parser.add_argument("--worker", action="store_true", help="internal: run as an MPI rank")
    args = parser.parse_args()
    if args.worker:
        worker(args.repeats, args.big_mb)
        return
    mpirun = Path(sys.executable).parent / "mpirun"
    if not mpirun.exists():
        sys.exit(f"{mpirun} not found: install MPICH into this venv (pip install mpi4py mpich)")
    cmd = [str(mpirun), "-n", "2", sys.executable, "-m", "mpi4py", "-m", "tools.bench_transfer", "--worker"]
    cmd += ["--repeats", str(args.repeats), "--big-mb", str(args.big_mb)]
    env = {"MC_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env={**os.environ, **env}, cwd=Path(__file__).resolve().parents[1])
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
