"""Moving weights and KV caches between ranks: a small buffer interface and two typed users of it.

A `BufferTransport` publishes named tensors as one flat buffer (see gyre.comm.flat) and returns a
`BufferHandle`, a picklable description that goes to the peers through the control plane (e.g. in a
`WeightVersion` message); a peer fetches the buffer with the handle. Two implementations:
- `mooncake` (gyre.comm.mooncake_transport): the owner registers the buffer with Mooncake Transfer
  Engine and peers read it one-sidedly (TCP on CPU, RDMA on clusters); `serve` does nothing.
- `gloo` (gyre.comm.gloo_transport): torch.distributed point to point; the owner must call
  `serve(handle, peers)` while those peers `fetch`.
Every transfer carries its version inside the bytes, and fetch checks it against the handle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from gyre.comm.flat import FlatLayout
from gyre.comm.kv_migration import KVMeta, SessionKV
from gyre.config.schema import CommConfig, MooncakeConfig

WEIGHTS_KEY = "weights"


@dataclass(frozen=True)
class BufferHandle:
    key: str
    version: str
    layout: FlatLayout
    owner_rank: int  # who serves it (two-sided transports)
    transport: str
    session: str = ""  # Mooncake: the owner engine's "host:rpc_port"
    address: int = 0  # Mooncake: the buffer's address in the owner's memory
    meta: Any = None  # what the typed transport needs to rebuild its object (e.g. KVMeta)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes


@dataclass(frozen=True)
class ShardHandles:
    """One weight version published shard by shard: `shards[i]` is what rank i of the publishing cell holds
    (its local megatron tensors), pulled by rank i of each other cell of the same layout."""

    shards: tuple[BufferHandle, ...]

    @property
    def version(self) -> str:
        return self.shards[0].version

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.shards)


class BufferTransport(Protocol):
    name: str

    def publish(
        self, key: str, tensors: Mapping[str, torch.Tensor], version: str, meta: Any = None
    ) -> BufferHandle: ...

    def serve(self, handle: BufferHandle, peers: Sequence[int]) -> None: ...

    def fetch(self, handle: BufferHandle, reuse_buffer: bool = False) -> dict[str, torch.Tensor]:
        """The handle's tensors, as views into a receive buffer: a fresh one, or with `reuse_buffer` the
        one kept for this key (no allocation or page faults; the next reusing fetch overwrites it)."""
        ...

    def release(self, key: str) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class VersionedState:
    state: dict[str, torch.Tensor]
    version: str


class WeightTransport:
    """The core publishes its state dict under a version; satellites and engines pull it."""

    def __init__(self, transport: BufferTransport) -> None:
        self.transport = transport

    def publish(self, state: Mapping[str, torch.Tensor], version: str) -> BufferHandle:
        return self.transport.publish(WEIGHTS_KEY, state, version)

    def serve(self, handle: BufferHandle, peers: Sequence[int]) -> None:
        self.transport.serve(handle, peers)

    def pull(self, handle: BufferHandle, reuse_buffer: bool = False) -> VersionedState:
        """With `reuse_buffer` the tensors are overwritten by the next reusing pull: load them at once."""
        return VersionedState(self.transport.fetch(handle, reuse_buffer), handle.version)


class KVTransport:
    """Moves one in-flight session's keys/values; its version is the weight version that made them."""

    def __init__(self, transport: BufferTransport) -> None:
        self.transport = transport

    @staticmethod
    def key(rid: str) -> str:
        return f"kv/{rid}"

    def publish(self, kv: SessionKV) -> BufferHandle:
        return self.transport.publish(self.key(kv.meta.rid), {"k": kv.k, "v": kv.v}, kv.meta.weight_version, kv.meta)

    def serve(self, handle: BufferHandle, peers: Sequence[int]) -> None:
        self.transport.serve(handle, peers)

    def pull(self, handle: BufferHandle) -> SessionKV:
        if not isinstance(handle.meta, KVMeta):
            raise TypeError(f"handle {handle.key!r} carries no KVMeta; publish it with KVTransport.publish")
        tensors = self.transport.fetch(handle)
        return SessionKV(handle.meta, tensors["k"], tensors["v"])

    def release(self, handle: BufferHandle) -> None:
        self.transport.release(handle.key)


def make_transport(comm: CommConfig, mooncake: MooncakeConfig | None = None) -> BufferTransport:
    """The transport named by `comm.transfer_backend`; gloo needs torch.distributed initialised."""
    if comm.transfer_backend == "mooncake":
        from gyre.comm.mooncake_transport import MooncakeTransport

        fabric = mooncake or MooncakeConfig()
        return MooncakeTransport(comm.hostname, fabric.protocol, fabric.device_name, fabric.metadata_server)
    if comm.transfer_backend == "gloo":
        from gyre.comm.gloo_transport import GlooTransport

        return GlooTransport()
    raise ValueError(f"comm.transfer_backend must be 'mooncake' or 'gloo', got {comm.transfer_backend!r}")
