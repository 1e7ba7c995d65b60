"""Logits -> log-probabilities of given tokens: the one place the trainer turns logits into logprobs."""

from __future__ import annotations

import torch


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [..., V] (fp32), targets [...] long -> log softmax(logits)[target] as [...] fp32."""
    return logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
