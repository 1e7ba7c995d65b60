"""`BufferTransport` over Mooncake Transfer Engine: the owner registers, peers read one-sidedly.

No metadata service: engines find each other by P2P handshake ("P2PHANDSHAKE"), the handle naming
the owner's "host:rpc_port". Each key keeps two registered buffers used in turn, so the owner can
publish version N+1 while a slow peer still reads version N; a peer two versions behind would read
overwritten bytes, which the version header inside the buffer catches (VersionMismatch: pull again).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gyre.comm.address import advertise_address
from gyre.comm.flat import FlatLayout, layout_of, pack_into, unpack
from gyre.comm.transfer import BufferHandle

INSTALL_HINT = (
    "install Mooncake with `pip install mooncake-transfer-engine-non-cuda` (CPU) or "
    "`mooncake-transfer-engine` (CUDA), plus the Debian package libibverbs1 (tools/setup_env.sh installs it)"
)


def _transfer_engine() -> Any:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # its INFO lines flood every rank's stderr
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise ImportError(f"Mooncake Transfer Engine is not importable ({e}); {INSTALL_HINT}") from e
    return TransferEngine()


def resolve_hostname(hostname: str) -> str:
    """comm.hostname as an address of this host (the cell job resolves it once, in its preflight)."""
    return advertise_address(hostname)


@dataclass
class _Published:
    layout: FlatLayout
    buffers: list[torch.Tensor] = field(default_factory=list)
    turn: int = 0


class MooncakeTransport:
    name = "mooncake"

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        metadata_server: str = "P2PHANDSHAKE",
        owner_rank: int = -1,
    ) -> None:
        self.engine = _transfer_engine()
        self.hostname = resolve_hostname(hostname)
        rc = self.engine.initialize(self.hostname, metadata_server, protocol, device_name)
        if rc != 0:
            raise RuntimeError(
                f"Mooncake TransferEngine.initialize({self.hostname!r}, {metadata_server!r}, {protocol!r}, "
                f"{device_name!r}) returned {rc}; check the protocol (tcp on CPU, rdma needs RDMA NICs named "
                "in cluster.mooncake.device_name) and that the hostname is this machine's address"
            )
        self.session = f"{self.hostname}:{self.engine.get_rpc_port()}"
        self.owner_rank = owner_rank
        self._published: dict[str, _Published] = {}
        self._received: dict[str, torch.Tensor] = {}  # registered receive buffers kept for reuse

    def _register(self, buffer: torch.Tensor) -> None:
        if (rc := self.engine.register_memory(buffer.data_ptr(), buffer.numel())) != 0:
            raise RuntimeError(f"Mooncake register_memory of {buffer.numel()} bytes returned {rc}")

    def _unregister(self, buffer: torch.Tensor) -> None:
        self.engine.unregister_memory(buffer.data_ptr())

    def publish(self, key: str, tensors: Mapping[str, torch.Tensor], version: str, meta: Any = None) -> BufferHandle:
        layout = layout_of(tensors)
        pub = self._published.get(key)
        if pub is None or pub.layout != layout:
            self.release(key)
            pub = self._published[key] = _Published(layout)
        if len(pub.buffers) < 2:
            buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
            self._register(buffer)
            pub.buffers.append(buffer)
        buffer = pub.buffers[pub.turn % len(pub.buffers)]
        pub.turn += 1
        pack_into(buffer, tensors, layout, version)
        return BufferHandle(key, version, layout, self.owner_rank, self.name, self.session, buffer.data_ptr(), meta)

    def serve(self, handle: BufferHandle, peers: Sequence[int]) -> None:
        """Nothing to do: peers read the registered buffer themselves."""

    def fetch(self, handle: BufferHandle, reuse_buffer: bool = False) -> dict[str, torch.Tensor]:
        kept = self._received.get(handle.key) if reuse_buffer else None
        if kept is not None and kept.numel() != handle.nbytes:
            self._unregister(self._received.pop(handle.key))
            kept = None
        buffer = kept if kept is not None else torch.empty(handle.nbytes, dtype=torch.uint8)
        if kept is None:
            self._register(buffer)
        try:
            rc = self.engine.transfer_sync_read(handle.session, buffer.data_ptr(), handle.address, handle.nbytes)
        finally:
            if reuse_buffer:
                self._received[handle.key] = buffer
            else:
                self._unregister(buffer)
        if rc != 0:
            raise RuntimeError(
                f"Mooncake read of {handle.key!r} ({handle.nbytes} bytes) from {handle.session} returned {rc}; "
                "is the owner still running and the buffer still published?"
            )
        return unpack(buffer, handle.layout, expect_version=handle.version)

    def release(self, key: str) -> None:
        """Drop what this rank published, and the receive buffer it kept, under `key`."""
        pub = self._published.pop(key, None)
        for buffer in pub.buffers if pub else []:
            self._unregister(buffer)
        if (kept := self._received.pop(key, None)) is not None:
            self._unregister(kept)

    def close(self) -> None:
        for key in {*self._published, *self._received}:
            self.release(key)
