import math

import numpy as np
import pytest
import torch

from gyre.train.gspo import group_advantages, gspo_loss, rollout_sequence_weights, sequence_log_ratio

pytestmark = pytest.mark.unit


def test_group_advantages_hand_computed():
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.5]])
    # mean 0.5, unbiased std = sqrt((0.25 + 0.25 + 0 + 0) / 3) = sqrt(1/6)
    std = math.sqrt(1 / 6)
    expected = torch.tensor([[0.5 / std, -0.5 / std, 0.0, 0.0]])
    assert torch.allclose(group_advantages(rewards, eps=0.0), expected, atol=1e-6)


def test_excluded_rollouts_are_nan_and_do_not_count():
    rewards = torch.tensor([[1.0, float("nan"), 0.0], [float("nan"), 1.0, float("nan")]])
    adv = group_advantages(rewards, eps=0.0)
    assert torch.isnan(adv[0, 1]) and torch.isnan(adv[1, 0]) and torch.isnan(adv[1, 2])
    # group 0: valid {1, 0}: mean 0.5, std sqrt(0.5)
    assert adv[0, 0].item() == pytest.approx(0.5 / math.sqrt(0.5))
    # group 1 has a single valid rollout: no signal, zero, not scored as anything else
    assert adv[1, 1].item() == 0.0


def test_equal_rewards_give_zero_advantage():
    assert torch.equal(group_advantages(torch.ones(2, 4)), torch.zeros(2, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("score", [0.1, 0.7, 0.3])
def test_one_failed_evaluation_and_seven_equal_scores_give_exactly_zero(score, dtype):
    # 7 * 0.1 / 7 != 0.1 in floating point: the mean does not round back, std is ~1e-17, and
    # (r - mean) / (std + eps) came out as 1.4e-11 (float64) or -0.0074 (float32) instead of 0
    rewards = torch.tensor([[float("nan")] + [score] * 7, [score] * 7 + [1.0]], dtype=dtype)
    adv = group_advantages(rewards)
    assert torch.isnan(adv[0, 0]) and torch.equal(adv[0, 1:], torch.zeros(7, dtype=dtype))
    assert bool((adv[1] != 0).all())  # one different score still carries signal


def test_sequence_log_ratio_uses_policy_tokens_only():
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    old = torch.tensor([[-1.5, -2.0, -9.0]])
    mask = torch.tensor([[1, 1, 0]])
    assert sequence_log_ratio(logp, old, mask).item() == pytest.approx(0.25)


def reference_gspo(logp, old, mask, adv, w, lo, hi):
    total = 0.0
    for i in range(logp.shape[0]):
        toks = [t for t in range(logp.shape[1]) if mask[i, t]]
        s = math.exp(sum(logp[i, t] - old[i, t] for t in toks) / max(len(toks), 1))
        total += w[i] * min(s * adv[i], min(max(s, 1 - lo), 1 + hi) * adv[i])
    return -total


def test_gspo_loss_matches_independent_reference():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 9, generator=g, dtype=torch.float64)
    old = logp + 0.05 * torch.randn(6, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 9, generator=g) > 0.3).to(torch.int64)
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    w = torch.full((6,), 1 / 6, dtype=torch.float64)
    loss, metrics = gspo_loss(logp, old, mask, adv, w, 0.02, 0.03)
    ref = reference_gspo(logp.numpy(), old.numpy(), mask.numpy(), adv.numpy(), w.numpy(), 0.02, 0.03)
    assert loss.item() == pytest.approx(ref, abs=1e-12)
    assert 0.0 <= metrics["clip_frac"] <= 1.0


def test_gspo_gradient_on_policy_pushes_advantage_direction():
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], requires_grad=True)
    old = logp.detach().clone()
    mask = torch.ones(2, 2)
    adv = torch.tensor([1.0, -1.0])
    loss, _ = gspo_loss(logp, old, mask, adv, torch.tensor([0.5, 0.5]), 3e-4, 4e-4)
    loss.backward()
    # minimising the loss raises logp of the positive-advantage sequence and lowers the other
    assert (logp.grad[0] < 0).all() and (logp.grad[1] > 0).all()
    assert np.allclose(logp.grad.numpy(), [[-0.25, -0.25], [0.25, 0.25]])


def test_clipping_stops_gradient_beyond_trust_region():
    logp = torch.tensor([[0.0]], requires_grad=True)
    old = torch.tensor([[-0.1]])  # ratio e^0.1 > 1 + eps_high
    loss, metrics = gspo_loss(logp, old, torch.ones(1, 1), torch.tensor([1.0]), torch.tensor([1.0]), 0.01, 0.01)
    loss.backward()
    assert logp.grad.abs().item() == 0.0
    assert metrics["clip_frac"] == 1.0


def test_rollout_weights_do_not_depend_on_number_of_paths():
    w = rollout_sequence_weights(torch.tensor([0, 0, 0, 1, 2, 2]))
    assert torch.allclose(w, torch.tensor([1 / 9, 1 / 9, 1 / 9, 1 / 3, 1 / 6, 1 / 6]))
    assert w.sum().item() == pytest.approx(1.0)
