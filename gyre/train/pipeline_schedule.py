"""Pipeline-parallel micro-batches over megatron's stages: all forwards, then all backwards (GPipe).

megatron's own schedules (1F1B, interleaved) allocate on "cuda" and synchronise CUDA streams, so on
CPU they do not run; this one drives the same GPTModel stages through torch.distributed point to point
messages on megatron's pipeline group (gloo on CPU, NCCL on CUDA). Each stage receives its input
activation [S, B, H] from the previous stage (its shape first: micro-batches differ in length), runs its
layers (model.set_input_tensor), and sends its output on; the last stage turns its logits into the
loss. Backwards run in reverse order, each stage sending its input's gradient back.

Activations of every micro-batch are held until its backward: peak memory grows with the number of
micro-batches per step (1F1B would bound it by the number of stages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gyre.train.megatron_gpt import parallel_state


class Stages:
    """This rank's neighbours on its pipeline group."""

    def __init__(self) -> None:
        self.group = parallel_state.get_pipeline_model_parallel_group()
        self.rank = parallel_state.get_pipeline_model_parallel_rank()
        self.size = parallel_state.get_pipeline_model_parallel_world_size()
        self.first, self.last = self.rank == 0, self.rank == self.size - 1
        ranks = dist.get_process_group_ranks(self.group)
        self.prev = None if self.first else ranks[self.rank - 1]
        self.next = None if self.last else ranks[self.rank + 1]
        self.last_rank = ranks[-1]

    def send_forward(self, out: torch.Tensor) -> None:
        dist.send(torch.tensor(out.shape, dtype=torch.int64, device=out.device), self.next, group=self.group)
        dist.send(out.detach().contiguous(), self.next, group=self.group)

    def recv_forward(self, device: torch.device) -> torch.Tensor:
        shape = torch.empty(3, dtype=torch.int64, device=device)
        dist.recv(shape, self.prev, group=self.group)
        x = torch.empty(tuple(shape.tolist()), dtype=torch.float32, device=device)
        dist.recv(x, self.prev, group=self.group)
        return x.requires_grad_()

    def broadcast_from_last(self, value: Any) -> Any:
        """The last stage's value (tensors moved to CPU), on every stage."""
        box = [value if self.last else None]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.group)
        return box[0]


def pipeline_step(
    model: torch.nn.Module,
    micro_batches: Sequence[Any],
    forward: Callable[[Any], torch.Tensor],
    last_stage: Callable[[torch.Tensor, Any], tuple[torch.Tensor | None, Any]],
    device: torch.device,
    backward: bool = True,
) -> list[Any]:
    """Run every micro-batch through the stages; `forward(mb)` runs this stage's model on it, `last_stage(
    output, mb)` turns the last stage's logits into (the loss to backpropagate or None, what to return).
    Returns, on every stage, the last stage's results in micro-batch order."""
    stages = Stages()
    inputs: list[torch.Tensor | None] = []
    outputs: list[torch.Tensor | None] = []
    results: list[Any] = []
    for mb in micro_batches:
        x = None if stages.first else stages.recv_forward(device)
        model.set_input_tensor(x)
        with torch.set_grad_enabled(backward):
            out = forward(mb)
        if stages.last:
            loss, result = last_stage(out, mb)
            outputs.append(loss)
            results.append(result)
        else:
            stages.send_forward(out)
            outputs.append(out)
        inputs.append(x)
    if backward:
        for x, out in zip(reversed(inputs), reversed(outputs), strict=True):
            if stages.last:
                out.backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, stages.next, group=stages.group)
                torch.autograd.backward(out, grad)
            if x is not None:
                dist.send(x.grad.contiguous(), stages.prev, group=stages.group)
    model.set_input_tensor(None)
    return stages.broadcast_from_last(results)
