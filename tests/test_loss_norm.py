"""rl.loss_norm: the step's GSPO loss divided by all rollouts (default) or by those with signal, by hand."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gyre.config.schema import RLConfig
from gyre.config.validate import ConfigValueError
from gyre.pipeline import loss_rollouts, rl_micro_batches, tree_gspo_loss_fn, with_signal
from gyre.traj.tree import TrajectoryTree

pytestmark = pytest.mark.unit


def rollout(rid: str, advantage: float, old: list[float]) -> SimpleNamespace:
    """A root token then len(old) policy tokens, each weighted 1 / len(old)."""
    n = len(old) + 1
    tree = TrajectoryTree(
        rollout_id=rid,
        tokens=np.arange(n, dtype=np.int32),
        parent=np.arange(-1, n - 1, dtype=np.int32),
        depth=np.arange(n, dtype=np.int32),
        policy=np.array([False] + [True] * len(old)),
        logprob=np.array([0.0, *old], np.float32),
        call_id=np.array([-1] + [1] * len(old), np.int64),
        role=np.zeros(n, np.uint8),
    )
    weight = np.array([0.0] + [1 / len(old)] * len(old), np.float32)
    return SimpleNamespace(rollout_id=rid, tree=tree, loss_weight=weight, meta=SimpleNamespace(advantage=advantage))


def step_loss(rollouts: list, loss_norm: str, logp_minus_old: dict[str, float]) -> float:
    trained = with_signal(rollouts)
    batches = rl_micro_batches(trained, 4096, 64, loss_rollouts(rollouts, loss_norm))
    loss_fn = tree_gspo_loss_fn(0.2, 0.2)
    total = 0.0
    for mb in batches:
        b = mb.batch
        shift = torch.tensor([logp_minus_old[b.rollout_ids[t]] for t in b.tree_index.tolist()])
        total += float(loss_fn(b.old_logprobs + shift * b.policy_mask, mb)[0])
    return total


@pytest.mark.parametrize(("loss_norm", "denominator"), [("all_rollouts", 4), ("with_signal", 2)])
def test_both_normalisations_against_hand_computed_values(loss_norm, denominator):
    rollouts = [
        rollout("a", 1.5, [-1.0, -2.0]),
        rollout("b", 0.0, [-1.0]),  # no signal: never trained, counted by all_rollouts only
        rollout("c", -0.5, [-0.5, -0.25, -3.0]),
        rollout("d", 0.0, [-2.0]),
    ]
    assert loss_rollouts(rollouts, loss_norm) == denominator
    # every policy token of a moves by +0.1 (ratio e^0.1 = 1.105, within the clip at 1.2), of c by -0.3
    # (ratio e^-0.3 = 0.741, below 0.8: clipped, and with A < 0 the min takes the clipped value 0.8 * A)
    a = min(math.exp(0.1) * 1.5, 1.2 * 1.5)
    c = min(math.exp(-0.3) * -0.5, 0.8 * -0.5)
    expected = -(a + c) / denominator
    got = step_loss(rollouts, loss_norm, {"a": 0.1, "b": 0.0, "c": -0.3, "d": 0.0})
    assert got == pytest.approx(expected, rel=1e-5)
    assert expected == pytest.approx(-(1.5 * 1.1051709 - 0.4) / denominator, rel=1e-6)


def test_loss_norm_default_and_unknown_value():
    assert RLConfig().loss_norm == "all_rollouts"
    with pytest.raises(ConfigValueError, match="rl.loss_norm='per_token'"):
        RLConfig(loss_norm="per_token")
