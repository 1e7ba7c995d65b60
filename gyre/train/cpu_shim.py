"""Make megatron-core 0.16 run on a machine without CUDA.

megatron-core's local (non Transformer Engine) layers call a few CUDA-only functions even when
`use_cpu_initialization=True`: `torch.cuda.current_device()` as a device argument (RoPE, the global
memory buffer that holds attention scores), the CUDA RNG tracker, which every attention forward
forks for dropout, and the default causal mask (built with device="cuda"). On a CPU-only torch these raise. This module redirects exactly those calls to
the CPU, and only when CUDA is unavailable, so GPU runs keep megatron's own behaviour.
"""

from __future__ import annotations

from typing import Any

import torch

_applied = False


def _cpu_device() -> str:
    return "cpu"


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _get_cpu_rng_state_any(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state_any(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    # The CPU generator only: megatron's CUDA RNG states now live in it.
    torch.default_generator.manual_seed(int(seed))


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def cpu_shim_needed() -> bool:
    return not torch.cuda.is_available()


def apply_cpu_shim() -> bool:
    """Redirect megatron's CUDA-only calls to the CPU when CUDA is unavailable.

    Idempotent. Returns True when the shim is (now or already) active, False on a CUDA machine.
    Call it before building a megatron model.
    """
    global _applied
    if _applied:
        return True
    if not cpu_shim_needed():
        return False
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.current_device = _cpu_device
    torch.cuda.manual_seed = _cpu_manual_seed
    torch.cuda.get_rng_state = _get_cpu_rng_state_any
    torch.cuda.set_rng_state = _set_cpu_rng_state_any
    mcore_random._get_cuda_rng_state = _get_cpu_rng_state
    mcore_random._set_cuda_rng_state = _set_cpu_rng_state
    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    _applied = True
    return True
