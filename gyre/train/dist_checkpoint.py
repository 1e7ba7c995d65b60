"""The trainer's checkpoint as torch.distributed.checkpoint (DCP): sharded, and readable by any layout.

Every rank of the trainer world writes its own shards into one directory (`__<rank>_0.distcp` files and
a `.metadata` index); a checkpoint written with one tensor/pipeline/data-parallel layout loads into any
other (train.tensor_parallel=2 -> 1 and back, pipeline stages regrouped), because each tensor is stored
under its whole-model name as a piece of the whole-model tensor:
- model weights under megatron's whole-model names (gyre.model.weights' layout: decoder.layers.<global
  index>...), a tensor-parallel shard as a DTensor Shard(dim) over the tensor-parallel group (dims as in
  gyre.train.shard_weights); the GLU weight linear_fc1 as its two halves `.gate` and `.up`, which are each
  split by rows (its local layout, gate block over up block, is not a slice of the whole);
- AdamW's state under `optimizer.exp_avg.<name>`, `optimizer.exp_avg_sq.<name>` (sharded exactly as the weight it
  belongs to) and `optimizer.step.<name>`;
- `trainer.meta`, JSON: the step counter, the ModelConfig (loading checks the architecture), the param
  groups' hyperparameters and whether AdamW has state yet.
Replicas (data-parallel, and norms over tensor-parallel ranks) are written once (DCP's dedup).

megatron-core's dist_checkpointing is not used: its torch_dist writer starts a multiprocessing manager
for async writes, and the optimizer here is torch's AdamW, not megatron's.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DeviceMesh, DTensor, Shard

from gyre.config.schema import ModelConfig
from gyre.train.shard_weights import GLU, expert_parallel_rank_size, expert_to_global, split_dim, stage_layers

METADATA = ".metadata"
META = "trainer.meta"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_ADAM = ("exp_avg", "exp_avg_sq")


def is_dcp_checkpoint(path: str | Path) -> bool:
    return (Path(path) / METADATA).exists()


def _global_name(local: str, layer_offset: int) -> str:
    m = _LAYER.match(local)
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{m.group(2)}" if m else local


def _tp_mesh() -> DeviceMesh | None:
    from gyre.train.megatron_gpt import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return DeviceMesh.from_group(parallel_state.get_tensor_model_parallel_group(), device)


def _pieces(name: str, tensor: torch.Tensor, mesh: DeviceMesh | None, prefix: str = "") -> dict[str, torch.Tensor]:
    """A local tensor of parameter `name` (or of its optimizer state: `prefix`) as the stored items:
    whole-model pieces (DTensors under tensor parallelism)."""
    key = prefix + name
    if name.endswith(GLU):
        gate, up = tensor.chunk(2, dim=0)
        parts, dim = {key + ".gate": gate, key + ".up": up}, 0
    else:
        parts, dim = {key: tensor}, split_dim(name)
    if mesh is None or dim is None:
        return parts
    return {k: DTensor.from_local(v.contiguous(), mesh, [Shard(dim)], run_check=False) for k, v in parts.items()}


def _local(name: str, loaded: dict[str, Any], prefix: str = "") -> torch.Tensor:
    """The inverse of _pieces: this rank's local tensor from the loaded items."""

    def plain(key: str) -> torch.Tensor:
        value = loaded[key]
        return value.to_local() if isinstance(value, DTensor) else value

    if name.endswith(GLU):
        return torch.cat([plain(prefix + name + ".gate"), plain(prefix + name + ".up")], dim=0)
    return plain(prefix + name)


def _named_parameters(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters under their whole-model names."""
    from gyre.train.megatron_gpt import parallel_state

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    offset = stage_layers(cfg, pp_rank, pp_size).start
    ep_rank, ep_size = expert_parallel_rank_size()
    return {expert_to_global(_global_name(n, offset), cfg, ep_rank, ep_size): p for n, p in model.named_parameters()}


def _state_items(
    params: dict[str, torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    mesh: DeviceMesh | None,
    *,
    empty: bool,
    with_optimizer: bool,
    copy: bool = False,
) -> dict[str, Any]:
    """What this rank stores (empty=True: buffers of the same shapes to load into; copy=True: clones on the CPU). A
    parameter AdamW has no state for (it never had a gradient) is stored with AdamW's initial state: zero moments,
    step 0."""

    def like(t: torch.Tensor) -> torch.Tensor:
        if empty:
            return torch.empty_like(t)
        return t.detach().to("cpu", copy=True) if copy else t.detach()

    items: dict[str, Any] = {}
    for name, p in params.items():
        items |= _pieces(name, like(p), mesh)
        if not with_optimizer:
            continue
        state = {} if empty else optimizer.state.get(p, {})
        for key in _ADAM:
            moment = like(p) if empty else like(state.get(key, torch.zeros_like(p)))
            items |= _pieces(name, moment, mesh, prefix=f"optimizer.{key}.")
        step = state.get("step", torch.tensor(0.0))
        items[f"optimizer.step.{name}"] = torch.zeros((), dtype=torch.float32) if empty else like(step)
    return items


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def save_sharded(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: ModelConfig, step: int
) -> None:
    """Every rank of the trainer world calls it: this rank's shards of the weights and AdamW's state."""
    dcp.save(sharded_items(model, optimizer, cfg, step), checkpoint_id=str(path))


def sharded_items(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: ModelConfig, step: int, copy: bool = False
) -> dict[str, Any]:
    """What save_sharded stores of this rank. copy=True: a snapshot (tensors cloned) that later updates of the
    model and optimizer leave alone, for a write in the background (SnapshotWriter). Collective over the
    trainer world (whether AdamW has state anywhere)."""
    params = _named_parameters(model, cfg)
    flags = torch.tensor([int(any(optimizer.state.get(p) for p in params.values()))])
    if dist.get_world_size() > 1:  # AdamW has state on some rank: every rank stores its part of it
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    with_optimizer = bool(flags.item())
    items = _state_items(params, optimizer, _tp_mesh(), empty=False, with_optimizer=with_optimizer, copy=copy)
    meta = {"step": step, "model_config": asdict(cfg), "optimizer_state": with_optimizer}
    meta["param_groups"] = _hyperparameters(optimizer)
    items[META] = json.dumps(meta)  # a string: DCP would flatten a dict into keys of its own
    return items


class SnapshotWriter:
    """This rank's snapshot (sharded_items(copy=True)), written by `write` on another thread. Over several ranks the
    write's collectives run on a process group of their own (as torchtitan's async checkpoint does), so they never
    interleave with the training's on the default group; every rank makes it at its first snapshot, in order."""

    _group: Any = None

    def __init__(self, items: dict[str, Any]) -> None:
        self.items = items
        if dist.get_world_size() > 1 and SnapshotWriter._group is None:
            SnapshotWriter._group = dist.new_group(backend="gloo")

    def write(self, path: str | Path) -> None:
        dcp.save(self.items, checkpoint_id=str(path), process_group=SnapshotWriter._group)


def read_meta(path: str | Path) -> dict[str, Any]:
    """The checkpoint's step counter, ModelConfig (as a dict), param groups and whether it has AdamW's state."""
    header: dict[str, Any] = {META: ""}
    dcp.load(header, checkpoint_id=str(path))
    return json.loads(header[META])


def architecture(model_config: dict[str, Any]) -> dict[str, Any]:
    """A ModelConfig dict without the keys that do not change the weights' shapes or meaning."""
    return {k: v for k, v in model_config.items() if k not in ("seed", "init_std", "init", "path", "chat_template")}


def load_sharded(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: ModelConfig) -> int:
    """Load what save_sharded wrote, with whatever layout it was written, into this rank's shards; returns
    the step counter. Every rank of the trainer world calls it."""
    meta = read_meta(path)
    if architecture(meta["model_config"]) != architecture(asdict(cfg)):
        raise ValueError(
            f"checkpoint {path} was written for model config {meta['model_config']}, this trainer has "
            f"{asdict(cfg)}; build the trainer from the checkpoint's config"
        )
    params = _named_parameters(model, cfg)
    with_optimizer = bool(meta["optimizer_state"])
    items = _state_items(params, optimizer, _tp_mesh(), empty=True, with_optimizer=with_optimizer)
    dcp.load(items, checkpoint_id=str(path))
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(_local(name, items))
    optimizer.state.clear()  # a checkpoint without AdamW's state: the next step starts it afresh
    if with_optimizer:
        for name, p in params.items():
            optimizer.state[p] = {key: _local(name, items, f"optimizer.{key}.").clone() for key in _ADAM}
            optimizer.state[p]["step"] = items[f"optimizer.step.{name}"].clone()
    for group, saved in zip(optimizer.param_groups, meta["param_groups"], strict=True):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})  # betas
    return int(meta["step"])


def read_whole(path: str | Path) -> dict[str, Any]:
    """The whole checkpoint in one process, no trainer world: whole-model tensors (linear_fc1 as `.gate` and
    `.up`), `optimizer.{exp_avg,exp_avg_sq,step}.<name>` and `trainer.meta` (JSON, see read_meta). For checks and tools."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        return _load_state_dict_from_keys(checkpoint_id=str(path))
