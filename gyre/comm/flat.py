"""Tensors packed into one contiguous byte buffer behind a version header, and back.

A transfer moves one buffer: a 64-byte header (magic, then the version as UTF-8) and the tensors'
raw bytes at 64-byte aligned offsets. The name -> offset table (`FlatLayout`) travels beside it in
the transfer handle; the version travels inside it, so a reader can check that the bytes it got
are the version it asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

MAGIC = b"GYREBUF1"
HEADER_BYTES = 64
ALIGN = 64


class VersionMismatch(RuntimeError):
    """The bytes read carry another version than the handle announced (republished meanwhile)."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    offset: int  # bytes from the start of the buffer (header included)
    shape: tuple[int, ...]
    dtype: str  # e.g. "float32"

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * torch.empty(0, dtype=_dtype(self.dtype)).element_size()


@dataclass(frozen=True)
class FlatLayout:
    entries: tuple[TensorEntry, ...]
    nbytes: int  # whole buffer, header included


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a flat layout")
    return dtype


def layout_of(tensors: Mapping[str, torch.Tensor]) -> FlatLayout:
    entries, offset = [], HEADER_BYTES
    for name, t in tensors.items():
        entry = TensorEntry(name, offset, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        entries.append(entry)
        offset += -(-entry.nbytes // ALIGN) * ALIGN
    return FlatLayout(tuple(entries), offset)


def encode_version(version: str) -> torch.Tensor:
    raw = version.encode()
    if len(raw) > HEADER_BYTES - len(MAGIC):
        raise ValueError(f"version {version!r} is longer than {HEADER_BYTES - len(MAGIC)} bytes")
    header = MAGIC + raw + bytes(HEADER_BYTES - len(MAGIC) - len(raw))
    return torch.frombuffer(bytearray(header), dtype=torch.uint8)


def read_version(buffer: torch.Tensor) -> str:
    header = bytes(buffer[:HEADER_BYTES].tolist())
    if not header.startswith(MAGIC):
        raise ValueError("buffer has no gyre header: it was not written by pack_into (or not written yet)")
    return header[len(MAGIC) :].rstrip(b"\0").decode()


def pack_into(buffer: torch.Tensor, tensors: Mapping[str, torch.Tensor], layout: FlatLayout, version: str) -> None:
    """Write the tensors and the version header into a uint8 buffer of `layout.nbytes`."""
    if buffer.dtype != torch.uint8 or buffer.numel() != layout.nbytes:
        raise ValueError(f"buffer must be uint8 of {layout.nbytes} bytes, got {buffer.dtype} x {buffer.numel()}")
    for entry in layout.entries:
        t = tensors[entry.name].detach()
        if tuple(t.shape) != entry.shape or str(t.dtype).removeprefix("torch.") != entry.dtype:
            raise ValueError(
                f"tensor {entry.name} is {t.dtype} {tuple(t.shape)}, layout says {entry.dtype} {entry.shape}"
            )
        view = buffer[entry.offset : entry.offset + entry.nbytes].view(t.dtype).view(entry.shape)
        view.copy_(t)
    buffer[:HEADER_BYTES] = encode_version(version)


def pack(tensors: Mapping[str, torch.Tensor], version: str) -> tuple[torch.Tensor, FlatLayout]:
    layout = layout_of(tensors)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    pack_into(buffer, tensors, layout, version)
    return buffer, layout


def unpack(buffer: torch.Tensor, layout: FlatLayout, expect_version: str | None = None) -> dict[str, torch.Tensor]:
    """Views of the tensors inside `buffer` (they share its memory); checks the version header."""
    if expect_version is not None and (got := read_version(buffer)) != expect_version:
        raise VersionMismatch(f"buffer holds version {got!r}, expected {expect_version!r}; pull again")
    out = {}
    for e in layout.entries:
        out[e.name] = buffer[e.offset : e.offset + e.nbytes].view(_dtype(e.dtype)).view(e.shape)
    return out
