"""Summing replicas' gradients on the core with MPI point-to-point messages of flat fp32 vectors.

Each contributor sends two buffers to the core (which parameters have gradients, then the values);
the core receives from every contributor and adds them up. Waits test the requests with a sleep in
between (gyre.comm.control's rule: MPICH's blocking waits busy-poll a core).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from mpi4py import MPI

from gyre.comm.control import ControlPlane

GRAD_TAG = 4343
Waiter = Callable[[Callable[[], bool | None], float | None], bool | None]


class ReduceError(RuntimeError):
    """A gradient transfer did not complete in time (a contributor died mid-reduction)."""


def _wait_all(requests: list[MPI.Request], wait_for: Waiter, timeout: float, what: str) -> None:
    if wait_for(lambda: True if MPI.Request.Testall(requests) else None, timeout) is None:
        raise ReduceError(f"{what} did not complete within {timeout} s; is every contributor alive?")


def send_gradients(cp: ControlPlane, core_rank: int, flat: torch.Tensor, has: torch.Tensor, timeout: float) -> None:
    """Over the job's world communicator (cp.comm), waiting as the control plane waits (cp.wait_for)."""
    comm = cp.comm
    mask, values = has.numpy(), flat.contiguous().numpy()
    requests = [comm.Isend(mask, dest=core_rank, tag=GRAD_TAG), comm.Isend(values, dest=core_rank, tag=GRAD_TAG + 1)]
    _wait_all(requests, cp.wait_for, timeout, f"sending gradients to rank {core_rank}")


def receive_gradients(
    cp: ControlPlane, sources: Sequence[int], numel: int, n_params: int, timeout: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the sources' flat gradients, OR of their has-gradient masks)."""
    comm = cp.comm
    buffers: list[tuple[Any, Any]] = [
        (torch.zeros(n_params, dtype=torch.uint8).numpy(), torch.zeros(numel, dtype=torch.float32).numpy())
        for _ in sources
    ]
    requests = []
    for src, (mask, values) in zip(sources, buffers, strict=True):
        requests += [comm.Irecv(mask, source=src, tag=GRAD_TAG), comm.Irecv(values, source=src, tag=GRAD_TAG + 1)]
    _wait_all(requests, cp.wait_for, timeout, f"receiving gradients from ranks {list(sources)}")
    total = torch.zeros(numel, dtype=torch.float32)
    has = torch.zeros(n_params, dtype=torch.uint8)
    for mask, values in buffers:
        total += torch.from_numpy(values)
        has |= torch.from_numpy(mask)
    return total, has
