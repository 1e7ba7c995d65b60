"""Trainer-side halves of SGLang's weight-update endpoints.

Weights travel in HF names and layout (gyre.model.weights.megatron_to_hf), which SGLang's model
loaders map onto their fused, TP-sharded parameters themselves.

- `/update_weights_from_tensor`: same node. Each TP rank gets a base64 string of
  `ForkingPickler.dumps([(name, tensor), ...])` (SGLang's MultiprocessingSerializer); CUDA tensors
  travel as CUDA IPC handles, so nothing is copied through HTTP but the handles.
- `/update_weights_from_distributed`: any node. The engine joins a torch.distributed group with the
  trainer (`/init_weights_update_group`, trainer rank 0, engine ranks from rank_offset), the HTTP
  request announces names, dtypes and shapes, and the trainer broadcasts each tensor in that order, or,
  with load_format "flattened_bucket", a bucket of them as one byte buffer (SGLang's FlattenedTensorBucket:
  the tensors' bytes back to back in the announced order), one broadcast per bucket.

A trainer of several ranks sends shard by shard: each pipeline stage's first tensor-parallel rank gathers its
stage's TP shards (megatron's layout is not the engine's: SGLang's load_weights takes whole HF tensors and
splits them over its own TP ranks), names them as HF does (stage_hf_state) and broadcasts them in buckets to
the engine over a group of its own (SGLang 0.5.23 gives an engine rank `rank_offset + tp_rank` in a group
whose source is rank 0, so each sender needs its own group; one engine joins several).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist

from gyre.config.schema import ModelConfig

FLATTENED_BUCKET = "flattened_bucket"  # UpdateWeightsFromDistributedReqInput.load_format for bucketed broadcasts
BUCKET_BYTES = 512 << 20  # a bucket's size: big enough to amortise a request, small enough to stage beside the model


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


def stage_hf_state(stage: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names and layout (gyre.model.weights.megatron_to_hf) for the whole-tensor megatron parameters one
    pipeline stage holds (global layer numbers, TP shards merged): the rest of the model stands in as meta
    tensors, converted alongside and dropped, so a stage's names are exactly those of the whole model's."""
    from gyre.model.pretrained import expected_hf_shapes
    from gyre.model.weights import hf_to_megatron, megatron_to_hf

    fused = any(k.endswith(".linear_qkv.layer_norm_weight") for k in stage)
    meta_hf = {k: torch.empty(shape, device="meta") for k, shape in expected_hf_shapes(cfg).items()}
    whole = hf_to_megatron(meta_hf, cfg, fused_norms=fused)
    if unknown := sorted(set(stage) - set(whole)):
        raise KeyError(f"not parameters of the model model.* describes: {unknown[:5]}")
    whole |= stage
    return {k: v for k, v in megatron_to_hf(whole, cfg).items() if v.device.type != "meta"}


def tp_merged_stage(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """This pipeline stage's parameters, whole (TP shards all-gathered over the tensor-parallel group, experts
    over the expert-parallel group: every rank of them calls this), under global layer numbers."""
    from gyre.train.megatron_gpt import parallel_state
    from gyre.train.shard_weights import _gather_experts, _global_names, _tp_merge, stage_layers

    local = {k: v.detach() for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if tp_size > 1:
        group = parallel_state.get_tensor_model_parallel_group()
        for name in sorted(local):  # every rank of the group walks the same names in the same order
            shards = [torch.empty_like(local[name]) for _ in range(tp_size)]
            dist.all_gather(shards, local[name].contiguous(), group=group)
            local[name] = _tp_merge(name, shards)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    return _gather_experts(_global_names(local, stage_layers(cfg, pp_rank, pp_size).start), cfg)


def sends_weights(tp_rank: int, dp_rank: int = 0) -> bool:
    """Whether a trainer rank broadcasts its stage's weights to the engines: the first of its TP group in the
    first data-parallel replica (the others hold the same stage)."""
    return tp_rank == 0 and dp_rank == 0


def weight_group_name(server: int, stage: int) -> str:
    """The broadcast group between pipeline stage `stage`'s sender and engine server `server`."""
    return f"gyre_weights_{server}_stage{stage}"


def weight_buckets(state: dict[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[dict[str, torch.Tensor]]:
    """`state` in order, cut into buckets of at most bucket_bytes (a bigger tensor alone) and of one dtype
    each: SGLang's FlattenedTensorBucket.empty refuses a tensor at a byte offset its dtype does not divide."""
    buckets: list[dict[str, torch.Tensor]] = []
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        last = buckets[-1] if buckets else None
        if last is None or size + nbytes > bucket_bytes or next(iter(last.values())).dtype != tensor.dtype:
            buckets.append({})
            size = 0
        buckets[-1][name] = tensor
        size += nbytes
    return buckets


def flatten_bucket(bucket: dict[str, torch.Tensor]) -> torch.Tensor:
    """The bucket's bytes back to back in its order: what FlattenedTensorBucket.reconstruct_tensors reads."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in bucket.values()])
