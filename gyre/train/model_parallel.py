"""Megatron's model-parallel layout inside one trainer world: tensor x pipeline x data parallel ranks.

The world is torch.distributed's default group: gloo on CPU, NCCL on CUDA, started by the cell job
over the cell's ranks (gyre.sched.launch.job), by torchrun/srun through its env variables, or here as a
one-process world. megatron's parallel_state then splits it into tensor-parallel groups (adjacent
ranks), pipeline stages and data-parallel replicas of the rest.

This module also finishes a step's gradients the way megatron's finalize_model_grads does, without
its CUDA-only buffers: a sum over data-parallel replicas, a sum over tensor-parallel ranks of the
query/key norms (each rank normalises only its own heads with the shared weight), and a gradient
norm over every model-parallel rank that counts each replicated parameter once.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from gyre.config.schema import ModelConfig, TrainConfig
from gyre.train.backend import trainer_backend as trainer_backend  # where callers have found it
from gyre.train.cpu_shim import apply_cpu_shim
from gyre.train.megatron_gpt import parallel_state


def needs_model_parallel(train_cfg: TrainConfig) -> bool:
    sizes = (
        train_cfg.tensor_parallel,
        train_cfg.pipeline_parallel,
        train_cfg.context_parallel,
        train_cfg.expert_parallel,
    )
    return max(sizes) > 1


def rank_device(local_rank: int) -> torch.device:
    """The device a trainer rank runs on: GPU `local_rank` of its node, made current (megatron's layers and
    NCCL use the current device), or the CPU on a machine without CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f"trainer rank {local_rank} of its node sees {count} GPU(s): one rank per GPU; give the cell at most "
            f"cluster.*.gpus_per_node tasks per node (cluster.*.tasks_per_node) or expose more GPUs"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_model_parallel(train_cfg: TrainConfig, model_cfg: ModelConfig) -> None:
    """megatron's TP/PP/CP groups over the default world, started here when nobody has: a one-process
    world (in-process store) or, with WORLD_SIZE set (torchrun, srun), the env:// rendezvous."""
    apply_cpu_shim()
    cuda = torch.cuda.is_available()
    if train_cfg.context_parallel > 1 and not cuda:
        raise RuntimeError("train.context_parallel > 1 needs CUDA GPUs (megatron's ring attention); keep it at 1")
    if not dist.is_initialized():
        backend = trainer_backend()
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            rank_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend=backend)
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), world_size=1, rank=0)
    world = dist.get_world_size()
    model_parallel = train_cfg.tensor_parallel * train_cfg.pipeline_parallel * train_cfg.context_parallel
    if world % model_parallel:
        raise RuntimeError(
            f"the trainer's world has {world} ranks, not a multiple of train.tensor_parallel x pipeline_parallel x "
            f"context_parallel = {model_parallel}: give the cell a multiple of that many tasks"
        )
    if train_cfg.expert_parallel > 1 and world != model_parallel * train_cfg.expert_parallel:
        raise RuntimeError(
            f"train.expert_parallel={train_cfg.expert_parallel}: the trainer's world has {world} ranks; expert "
            f"parallel needs exactly tensor_parallel x pipeline_parallel x expert_parallel = "
            f"{model_parallel * train_cfg.expert_parallel} (its ranks train the same micro-batches, as a cell's do)"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=train_cfg.tensor_parallel,
            pipeline_model_parallel_size=train_cfg.pipeline_parallel,
            context_parallel_size=train_cfg.context_parallel,
            expert_model_parallel_size=train_cfg.expert_parallel,
        )
        return
    have = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_context_parallel_world_size(),
    )
    want = (train_cfg.tensor_parallel, train_cfg.pipeline_parallel, train_cfg.context_parallel)
    if have != want:
        raise RuntimeError(
            f"this process already has megatron's groups for tensor/pipeline/context parallel {have}, the trainer "
            f"asks {want}: one process holds one layout (start a new process for another)"
        )


def _is_qk_norm(name: str) -> bool:
    return "q_layernorm" in name or "k_layernorm" in name


def _flat_all_reduce(grads: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum the tensors over `group` in one message (fp32), written back in place."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def is_expert(name: str) -> bool:
    """A parameter of one expert-parallel rank's own experts (the router and attention are replicated)."""
    return ".mlp.experts." in name


def finish_gradients(model: torch.nn.Module) -> None:
    """Make every rank's gradients those of the whole step: data-parallel sum, tensor-parallel sum of the
    query/key norms. A parameter without a gradient on this replica gets zeros (another may have one).

    Under expert parallelism the ranks of an expert-parallel group train the same micro-batches (megatron sees them
    as data-parallel): the replicated parameters' gradients are averaged over them (equal up to summation order),
    and each expert, which saw every rank's copy of its tokens (the all-gather dispatcher), is divided by EP."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for _, p in named:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        _flat_all_reduce([p.grad for n, p in named if _is_qk_norm(n)], parallel_state.get_tensor_model_parallel_group())
    ep = parallel_state.get_expert_model_parallel_world_size()
    if ep > 1:
        dense = [p.grad for n, p in named if not is_expert(n)]
        _flat_all_reduce(dense, parallel_state.get_data_parallel_group())
        for g in [*dense, *(p.grad for n, p in named if is_expert(n))]:
            g.div_(ep)
    elif parallel_state.get_data_parallel_world_size() > 1:
        _flat_all_reduce([p.grad for _, p in named], parallel_state.get_data_parallel_group())


def clip_gradients(model: torch.nn.Module, max_norm: float) -> float:
    """The global L2 norm of the gradients over the model-parallel ranks (a parameter replicated across
    tensor-parallel ranks counted once), and, when it exceeds max_norm, every gradient scaled to it."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    params = [p for _, p in named]
    square = torch.zeros((), dtype=torch.float64)
    experts = torch.zeros((), dtype=torch.float64)  # each expert-parallel rank's own experts, summed over them
    for name, p in named:
        if param_is_not_tensor_parallel_duplicate(p):
            (experts if is_expert(name) else square).add_(p.grad.double().pow(2).sum())
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        dist.all_reduce(experts, group=parallel_state.get_expert_model_parallel_group())
    square += experts
    group = parallel_state.get_model_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(square, group=group)
    norm = float(square.sqrt())
    if math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s rule
        for p in params:
            p.grad.mul_(scale)
    return norm
