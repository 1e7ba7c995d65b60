"""Tree tokens' logprobs from the model's last hidden states, the logits made in row chunks: no [tokens x vocab].

A micro-batch of n tokens would otherwise hold its [n, V] logits several times over (the logits, the rows
read at each target's parent, the tempered copy log-softmax saves, and in the backward pass the gradient
of each): about 5 x n x V floats, 2.4 GB per copy at n = 4,096 and a 150K vocabulary. Here the output
layer and the logprob of each target (gyre.train.sampling_logprobs, tempered or truncated) run on at
most max(LOGIT_CHUNK_ELEMENTS, MIN_CHUNK_ROWS x V) logits at a time; with gradient each chunk is checkpointed (torch.utils.checkpoint:
its logits are recomputed in the backward pass, not kept), so the logits cost a few copies of one chunk
whatever the budget. Everything after the output layer is row-wise, so the logprobs and gradients are
those of the whole logits up to floating-point summation order. The price is one more output-layer
forward per target token in a backward pass.

`hidden_states(model)` makes a megatron GPTModel return its final hidden states (after the final norm)
instead of logits, and `TargetLogprobs` turns them into the targets' logprobs through the model's own
output layer (tied embeddings included).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from gyre.train.sampling_logprobs import TokenSampling, sampled_token_logprobs

# Rows of one chunk: LOGIT_CHUNK_ELEMENTS // vocabulary (4 MiB of fp32 logits), but at least MIN_CHUNK_ROWS, as
# each chunk reads the whole output weight: fewer rows would make the output layer's matmul memory-bound.
LOGIT_CHUNK_ELEMENTS = 1 << 20
MIN_CHUNK_ROWS = 64


@contextmanager
def hidden_states(model: Any) -> Iterator[None]:
    """Within: model(...) returns [B, T, H] final hidden states (GPTModel without its output layer)."""
    before = model.post_process
    model.post_process = False  # GPTModel.forward returns the decoder's output, final norm applied
    try:
        yield
    finally:
        model.post_process = before


class TargetLogprobs:
    """The model's output layer and the sampled distribution's logprob, chunk by chunk over target rows."""

    def __init__(self, model: Any, chunk_elements: int = LOGIT_CHUNK_ELEMENTS) -> None:
        self.layer = model.output_layer
        self.weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        self.rows = max(MIN_CHUNK_ROWS, chunk_elements // int(model.vocab_size))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[R, H] hidden rows -> [R, V] fp32 logits (megatron's output layer takes [S, B, H])."""
        out, _ = self.layer(h[:, None], weight=self.weight)
        return out[:, 0].float()

    def _chunk(self, h: torch.Tensor, targets: torch.Tensor, sampling: TokenSampling) -> torch.Tensor:
        return sampled_token_logprobs(self.logits(h), targets, sampling)

    def __call__(
        self, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, sampling: TokenSampling
    ) -> torch.Tensor:
        """hidden [n, H], rows [T] (the hidden row that predicts each target), targets [T], sampling of the
        targets -> [T] fp32 logprobs, differentiable in hidden and the output layer's weights."""
        if targets.numel() == 0:  # still part of the graph: a segment without targets is backpropagated too
            return hidden[:0].float().sum(-1)
        grad = torch.is_grad_enabled() and hidden.requires_grad
        step = self.rows
        h_parts = torch.split(hidden[rows], step)  # one gather; split's backward is one concatenation
        parts = []
        for i, h in enumerate(h_parts):
            sl = slice(i * step, i * step + h.shape[0])
            s = TokenSampling(
                sampling.temperature[sl], sampling.top_p[sl], sampling.top_k[sl], sampling.min_p[sl], sampling.truncated
            )
            if grad:
                parts.append(checkpoint(self._chunk, h, targets[sl], s, use_reentrant=False))
            else:
                parts.append(self._chunk(h, targets[sl], s))
        return torch.cat(parts)
