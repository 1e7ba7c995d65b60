"""The trainer world's torch.distributed backend, chosen in one place and importable without megatron (the
engine asks it while a cell's replica thread may be importing megatron and torch.distributed's packages: two
threads importing the same package tree can see it partially initialised)."""

from __future__ import annotations

import torch


def trainer_backend(device: torch.device | None = None) -> str:
    """The trainer world's torch.distributed backend, chosen here only: NCCL when the rank trains on a GPU
    (megatron's DDP, distributed optimizer and TP/PP collectives on CUDA tensors), gloo on CPU."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return "nccl" if device.type == "cuda" else "gloo"
