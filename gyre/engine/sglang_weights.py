"""Trainer-side halves of SGLang's weight-update endpoints.

Weights travel in HF names and layout (gyre.model.weights.megatron_to_hf), which SGLang's model
loaders map onto their fused, TP-sharded parameters themselves.

- `/update_weights_from_tensor`: same node. Each TP rank gets a base64 string of
  `ForkingPickler.dumps([(name, tensor), ...])` (SGLang's MultiprocessingSerializer); CUDA tensors
  travel as CUDA IPC handles, so nothing is copied through HTTP but the handles.
- `/update_weights_from_distributed`: any node. The engine joins a torch.distributed group with the
  trainer (`/init_weights_update_group`, trainer rank 0, engine ranks from rank_offset), the HTTP
  request announces names, dtypes and shapes, and the trainer broadcasts each tensor in that order.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist


def serialize_named_tensors(named: Iterable[tuple[str, torch.Tensor]], tp_size: int = 1) -> list[str]:
    """The `serialized_named_tensors` field: one payload per TP rank (each rank reads its own index).

    Pickled once per rank: a CPU tensor travels as a file descriptor that can be received only once.
    """
    items = [(name, tensor.detach()) for name, tensor in named]
    payloads = []
    for _ in range(tp_size):
        buf = io.BytesIO()
        ForkingPickler(buf).dump(items)
        payloads.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return payloads


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the spelling SGLang resolves with getattr(torch, name)."""
    return str(dtype).removeprefix("torch.")


def distributed_metadata(state: dict[str, torch.Tensor]) -> tuple[list[str], list[str], list[list[int]]]:
    """names, dtypes, shapes for `/update_weights_from_distributed`, in broadcast order."""
    names = list(state)
    return names, [dtype_name(state[n].dtype) for n in names], [list(state[n].shape) for n in names]


def bind_weight_update_store(master_address: str, world_size: int, timeout_s: float = 600.0) -> dist.TCPStore:
    """Trainer rank 0's TCP store for the group, bound to a port the OS picks (`.port`): tell the
    engines that port in `/init_weights_update_group`; no other process can take it meanwhile."""
    timeout = timedelta(seconds=timeout_s)
    return dist.TCPStore(master_address, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


def open_weight_update_group(
    master_address: str,
    master_port: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "nccl",
    rank: int = 0,
    timeout_s: float = 600.0,
    store: dist.Store | None = None,
) -> dist.ProcessGroup:
    """A process group beside the trainer's default one, joined by the engines' TP ranks.

    Rendezvous as SGLang's init_custom_process_group does on the engine side: a TCP store at
    master_address:master_port, keys under a PrefixStore named after the group. Call it while the
    engines' `/init_weights_update_group` requests are in flight (both sides block until all join).
    Rank 0 passes the store from `bind_weight_update_store` (then master_port is its `.port`).
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store, rank, world_size = next(
            rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
        )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, backend_options=None, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def broadcast_state(state: dict[str, torch.Tensor], group: dist.ProcessGroup, src: int = 0) -> None:
    """Send (src) or receive every tensor of `state` in its order, in place; names must match the metadata."""
    for tensor in state.values():
        dist.broadcast(tensor, src=src, group=group)
