"""The cell's trainer world: one torch.distributed world over the cell's ranks, for megatron's layout.

What differs between a CPU cell and a GPU cell is decided here and in gyre.train.model_parallel
(trainer_backend, rank_device): the backend (gloo or NCCL), the GPU a rank drives (its rank among the
cell's ranks on its node) and the interface the backend's bootstrap sockets bind. Everything above it (the
control plane, megatron's groups, the pipeline schedule, the gradient reduction between cells, the groups
its ranks open with the cell's SGLang servers to send them weights: weight_group_backend) is one code path,
which CI runs over gloo.
"""

from __future__ import annotations

import ipaddress
import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from gyre.comm.address import interface_of
from gyre.train.model_parallel import rank_device, trainer_backend

# the variable each backend reads for the interface of its sockets (its own pick resolves the host name,
# which may give loopback)
SOCKET_IFNAME_ENV = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


def node_local_rank(comm: Any) -> int:
    """This rank's index among `comm`'s ranks on its node (collective over comm): the GPU it trains on."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return local.Get_rank()
    finally:
        local.Free()


def rendezvous_store(comm: Any, address: str, timeout: timedelta) -> dist.TCPStore:
    """A TCP store for a world over `comm`'s ranks: rank 0's at its own address on a port the kernel picks
    (no window in which another process can take it), broadcast to the others."""
    ipaddress.ip_address(address)  # ValueError on a placeholder or a name: resolve it first
    rank, size = comm.Get_rank(), comm.Get_size()
    store = dist.TCPStore(address, 0, size, True, timeout, wait_for_workers=False) if rank == 0 else None
    master, port = comm.bcast((address, store.port) if store is not None else None, root=0)
    return store or dist.TCPStore(master, port, size, is_master=False, timeout=timeout)


def init_trainer_world(comm: Any, address: str, local_rank: int | None = None, timeout_s: float = 300.0) -> str:
    """torch.distributed's default world over the cell's ranks (`comm`, an mpi4py communicator), on the
    backend trainer_backend() picks; on GPU each rank first takes the GPU of its node-local rank. `address`
    is this rank's own, resolved (gyre.comm.address.advertise_address). Returns the backend."""
    local_rank = node_local_rank(comm) if local_rank is None else local_rank
    device = rank_device(local_rank)  # NCCL binds a communicator to the current device: set it first
    backend = trainer_backend(device)
    env = SOCKET_IFNAME_ENV[backend]
    if not os.environ.get(env) and (interface := interface_of(address)):
        os.environ[env] = interface
    timeout = timedelta(seconds=timeout_s)
    store = rendezvous_store(comm, address, timeout)
    dist.init_process_group(backend, store=store, rank=comm.Get_rank(), world_size=comm.Get_size(), timeout=timeout)
    return backend


def weight_group_backend() -> str:
    """The backend of the broadcast groups a cell's ranks open with its SGLang servers (the engines join
    with it: /init_weights_update_group's `backend`): the cell world's own, as init_trainer_world chose it."""
    return str(dist.get_backend())
