"""One in-flight session's keys/values as the transports move them: what they are (`KVMeta`), the
tensors (`SessionKV`) and their flat-buffer form. Nothing here knows an engine: the embedded engine's
side (reading them out of its cache, offering them to its prefix cache) is gyre/engine/kv_session.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyre.comm.flat import FlatLayout, pack, unpack


@dataclass(frozen=True)
class KVMeta:
    rid: str
    token_ids: tuple[int, ...]  # the tokens whose keys/values these are, in order
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    weight_version: str  # the weights that computed them; valid only under the same weights

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.kv_heads, len(self.token_ids), self.head_dim)


@dataclass(frozen=True)
class SessionKV:
    meta: KVMeta
    k: torch.Tensor  # [layers, kv_heads, n, head_dim]
    v: torch.Tensor

    def __post_init__(self) -> None:
        for name, t in (("k", self.k), ("v", self.v)):
            if tuple(t.shape) != self.meta.shape:
                raise ValueError(f"session {self.meta.rid}: {name} is {tuple(t.shape)}, meta says {self.meta.shape}")

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


# ----- as one flat buffer -----
def session_kv_to_flat(kv: SessionKV) -> tuple[torch.Tensor, FlatLayout]:
    return pack({"k": kv.k, "v": kv.v}, kv.meta.weight_version)


def session_kv_from_flat(buffer: torch.Tensor, layout: FlatLayout, meta: KVMeta) -> SessionKV:
    tensors = unpack(buffer, layout, expect_version=meta.weight_version)
    return SessionKV(meta, tensors["k"], tensors["v"])
