"""Rollout routing replay (R3): the trainer routes each token to the experts the engine routed it to.

The engine records, per token and per MoE layer, the top-k expert ids it chose (gyre/model/llama.py SparseMoE's
`routed`); the trainer hands them to megatron-core's RouterReplay (megatron.core.transformer.moe.router_replay),
whose REPLAY_FORWARD action takes the given ids instead of the router's own top-k and gathers the router's
probabilities at them. The gating weights stay the trainer's (differentiable), only the choice is the engine's, so
training computes the distribution that was sampled even where the two routers' numerics would choose otherwise.

`routed` is [N, L, k] for the N tokens of one forward, in the order megatron's router sees them (a packed tree's
row; a padded batch [B, T] as time-major [T * B]); L is the model's MoE layers (gyre.model.moe.moe_layer_indices)
on this pipeline stage. The routers are this model's own (not RouterReplay's process-wide list, which holds every
model ever built in the process).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*")
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction


def model_replays(model: torch.nn.Module) -> list[RouterReplay]:
    """The RouterReplay of each MoE layer of `model`, in layer order (built with moe_enable_routing_replay)."""
    replays = [m.router_replay for m in model.modules() if isinstance(m, TopKRouter)]
    if any(r is None for r in replays):
        raise ValueError("this model's routers were built without moe_enable_routing_replay")
    return replays


@contextmanager
def replaying(model: torch.nn.Module, routed: torch.Tensor | None) -> Iterator[None]:
    """Within the block the model's forwards route the tokens as `routed` [N, L, k] says (None: their own routing).
    Every forward inside must be of those N tokens in that order."""
    if routed is None:
        yield
        return
    replays = model_replays(model)
    if routed.dim() != 3 or routed.shape[1] != len(replays):
        raise ValueError(f"routed experts of shape {tuple(routed.shape)}: expected [tokens, {len(replays)} MoE layers, "
                         "top-k]")  # fmt: skip
    routed = routed.long()
    # -1: the engine ran no forward of the token (a leaf's last token, which no other token attends to): any experts
    routed = torch.where(routed < 0, torch.arange(routed.shape[-1]).expand_as(routed), routed)
    for layer, replay in enumerate(replays):
        replay.set_target_indices(routed[:, layer])
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for replay in replays:
            replay.clear_router_replay_action()
            replay.clear_indices()


def padded_order(routed: torch.Tensor) -> torch.Tensor:
    """A padded batch's routed experts [B, T, L, k] in the router's token order [T * B, L, k]."""
    return routed.transpose(0, 1).reshape(-1, *routed.shape[2:])
