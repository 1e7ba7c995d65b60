"""`BufferTransport` over torch.distributed (gloo): the fallback when Mooncake is not available.

Point to point and two-sided: the owner calls `serve(handle, peers)` while each of those peers calls
`fetch(handle)`; the control plane tells both sides when. Sends use their own process group, so a
transfer never interleaves with the trainer's collectives on the default group.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gyre.comm.address import interface_of
from gyre.comm.flat import FlatLayout, pack, unpack
from gyre.comm.transfer import BufferHandle


def init_gloo_from_mpi(comm: Any, address: str = "127.0.0.1", timeout_s: float = 300.0) -> None:
    """Start torch.distributed (gloo) over the ranks of an mpi4py communicator. `address` is this rank's
    own, resolved (gyre.comm.address.advertise_address; never "auto" or a name): rank 0 starts the store
    there on a port the kernel picks (port 0: no window in which another process can take it) and
    broadcasts both; each rank's gloo pairs listen on the interface holding its address (GLOO_SOCKET_IFNAME,
    unless set), since gloo's own pick resolves the host name, which may give loopback."""
    ipaddress.ip_address(address)  # ValueError on a placeholder or a name: resolve it first
    if not os.environ.get("GLOO_SOCKET_IFNAME") and (interface := interface_of(address)):
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    timeout = timedelta(seconds=timeout_s)
    rank, size = comm.Get_rank(), comm.Get_size()
    store = dist.TCPStore(address, 0, size, True, timeout, wait_for_workers=False) if rank == 0 else None
    master, port = comm.bcast((address, store.port) if store is not None else None, root=0)
    if store is None:
        store = dist.TCPStore(master, port, size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
    global _transfer_group
    # new_group is collective over every rank: made here, where all of them are, not in GlooTransport, which
    # only the cells build (the controller, rank 0, never would, and the cells would wait for it forever)
    _transfer_group = dist.new_group(backend="gloo")


_transfer_group: dist.ProcessGroup | None = None


class GlooTransport:
    name = "gloo"

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "the gloo transport needs torch.distributed initialised on every rank first "
                "(gyre.comm.gloo_transport.init_gloo_from_mpi under mpirun)"
            )
        self.group = group or _transfer_group or dist.new_group(backend="gloo")
        self.rank = dist.get_rank()
        self._published: dict[str, tuple[torch.Tensor, FlatLayout, str]] = {}
        self._received: dict[str, torch.Tensor] = {}

    def publish(self, key: str, tensors: Mapping[str, torch.Tensor], version: str, meta: Any = None) -> BufferHandle:
        buffer, layout = pack(tensors, version)
        self._published[key] = (buffer, layout, version)
        return BufferHandle(key, version, layout, self.rank, self.name, meta=meta)

    def serve(self, handle: BufferHandle, peers: Sequence[int]) -> None:
        """Send the published buffer to each peer in turn (each must be in `fetch` for it)."""
        if handle.key not in self._published:
            raise KeyError(f"{handle.key!r} is not published on rank {self.rank}")
        buffer, _, version = self._published[handle.key]
        if version != handle.version:
            raise RuntimeError(f"{handle.key!r} is at version {version!r} here, the handle asks {handle.version!r}")
        for peer in peers:
            dist.send(buffer, dst=peer, group=self.group)

    def fetch(self, handle: BufferHandle, reuse_buffer: bool = False) -> dict[str, torch.Tensor]:
        buffer = self._received.get(handle.key) if reuse_buffer else None
        if buffer is None or buffer.numel() != handle.nbytes:
            buffer = torch.empty(handle.nbytes, dtype=torch.uint8)
            if reuse_buffer:
                self._received[handle.key] = buffer
        dist.recv(buffer, src=handle.owner_rank, group=self.group)
        return unpack(buffer, handle.layout, expect_version=handle.version)

    def release(self, key: str) -> None:
        self._published.pop(key, None)
        self._received.pop(key, None)

    def close(self) -> None:
        self._published.clear()
        self._received.clear()
