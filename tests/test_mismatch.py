"""Train/inference mismatch correction: the pure functions against references written here from the definitions
of verl (verl/trainer/ppo/rollout_corr_helper.py, core_algos.py compute_policy_loss_gspo), slime
(slime/backends/megatron_utils/loss.py: vanilla_tis_function, icepop_function) and AReaL
(areal/utils/functional/functional.py: apply_rejection_sampling, ppo_actor_loss_fn), and hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from gyre.config.load import compose
from gyre.config.schema import MismatchConfig
from gyre.config.validate import ConfigValueError
from gyre.train.gspo import gspo_loss
from gyre.train.mismatch import (
    behaviour_ratio,
    corrected_gspo_loss,
    correction_weights,
    mismatch_metrics,
    per_tree_mean,
)

pytestmark = pytest.mark.unit
EPS_LOW, EPS_HIGH = 0.02, 0.03


# ----- an independent reference: one rollout at a time, plain Python floats, the gradient written out -----


def reference_weights(prox: list[float], behav: list[float], w: list[float], kind: str, level: str,
                      cap: float, low: float, high: float) -> list[float]:  # fmt: skip
    """c_t of one rollout: slime's vanilla_tis_function (clamp at cap) / icepop_function (ratio in band, else
    0) per token; at sequence level AReaL's geometric mean exp(mean log ratio) for every token."""
    logs = [p - b for p, b in zip(prox, behav, strict=True)]
    if level == "sequence":
        mean = sum(wi * x for wi, x in zip(w, logs, strict=True)) / sum(w)
        logs = [mean] * len(logs)
    out = []
    for x in logs:
        rho = math.exp(x)
        if kind == "none":
            out.append(1.0)
        elif kind == "tis":
            out.append(min(rho, cap))
        else:
            out.append(rho if low <= rho <= high else 0.0)
    return out


def reference_rollout(logp: list[float], prox: list[float], w: list[float], c: list[float], adv: float,
                      scale: float) -> tuple[float, list[float]]:  # fmt: skip
    """(loss, dloss/dlogp) of one rollout. The GSPO ratio over the tokens with c > 0 (verl's and AReaL's updated
    loss mask); each token's loss is the clipped surrogate times its weight share and c (verl's pg_losses *
    rollout_is_weights, seq-mean-token-mean); the denominator keeps every target (slime, AReaL). The gradient of
    token t is share_t * c_t * A * s when the unclipped branch is the minimum, else 0."""
    kept = [wi if ci > 0 else 0.0 for wi, ci in zip(w, c, strict=True)]
    log_s = sum(k * (a - b) for k, a, b in zip(kept, logp, prox, strict=True)) / sum(kept) if sum(kept) else 0.0
    s = math.exp(log_s)
    clipped = min(max(s, 1 - EPS_LOW), 1 + EPS_HIGH)
    surrogate = min(s * adv, clipped * adv)
    live = s * adv <= clipped * adv  # the unclipped branch is the minimum: its gradient passes
    shares = [wi / sum(w) for wi in w]
    loss = -scale * sum(sh * ci for sh, ci in zip(shares, c, strict=True)) * surrogate
    grad = [-scale * sh * ci * adv * s if live else 0.0 for sh, ci in zip(shares, c, strict=True)]
    return loss, grad


def random_batch(seed: int, n_trees: int = 24, per_tree: int = 9):
    """Rollouts of per_tree tokens (the first a context root, weight 0), mismatch of 0.5 nats (tokens fall out of
    [0.5, 2] and over cap 2), policy moved by 0.1 nats (some rollouts clipped, some not), advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    n = n_trees * per_tree
    tree_index = torch.arange(n_trees).repeat_interleave(per_tree)
    weight = torch.rand(n, generator=g, dtype=torch.float64) + 0.1
    weight[::per_tree] = 0.0
    for r in range(n_trees):  # a sampled tree's weights sum to 1
        weight[tree_index == r] /= weight[tree_index == r].sum()
    prox = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    offset = 0.6 * torch.randn(n_trees, generator=g, dtype=torch.float64)  # a rollout's own drift: MIS cuts some
    behav = prox + offset[tree_index] + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
    logp = prox + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n_trees, generator=g, dtype=torch.float64)
    return logp, prox, behav, weight, tree_index, adv


CASES = [("none", "token"), ("tis", "token"), ("tis", "sequence"), ("mask", "token"), ("mask", "sequence")]


@pytest.mark.parametrize(("kind", "level"), CASES)
def test_loss_and_gradient_equal_the_reference_in_every_regime(kind, level):
    cap, low, high, scale = 2.0, 0.5, 2.0, 1 / 24
    regimes: dict[str, int] = {"in band": 0, "cut": 0, "clipped": 0, "unclipped": 0}
    for seed in range(3):
        logp, prox, behav, weight, index, adv = random_batch(seed)
        n_trees = adv.numel()
        ratio = behaviour_ratio(prox, behav, weight, index, n_trees, level)
        c = correction_weights(ratio, kind, cap, low, high)
        leaf = logp.clone().requires_grad_()
        per_rollout, s = corrected_gspo_loss(leaf, prox, weight, index, adv, c, EPS_LOW, EPS_HIGH)
        (per_rollout.sum() * scale).backward()
        per_rollout = per_rollout.detach()
        for r in range(n_trees):
            sel = (index == r).nonzero().squeeze(-1).tolist()
            targets = [i for i in sel if weight[i] > 0]

            def pick(x: torch.Tensor, targets: list[int] = targets) -> list[float]:
                return [float(x[i]) for i in targets]

            c_ref = reference_weights(pick(prox), pick(behav), pick(weight), kind, level, cap, low, high)
            assert pick(c) == pytest.approx(c_ref, rel=1e-12, abs=1e-12)
            loss_ref, grad_ref = reference_rollout(pick(logp), pick(prox), pick(weight), c_ref, float(adv[r]), scale)
            assert float(per_rollout[r].detach()) * scale == pytest.approx(loss_ref, abs=1e-6)
            assert pick(leaf.grad) == pytest.approx(grad_ref, abs=1e-6)
            rhos = pick(ratio)  # at the correction's level
            regimes["in band"] += sum(low <= x <= high for x in rhos)
            regimes["cut"] += sum(x > cap or x < low for x in rhos)
            live = float(s[r]) * float(adv[r]) <= min(max(float(s[r]), 1 - EPS_LOW), 1 + EPS_HIGH) * float(adv[r])
            regimes["clipped" if not live else "unclipped"] += 1
    assert all(v > 0 for v in regimes.values()), regimes


def test_without_correction_the_loss_and_gradient_are_gspos():
    """c = 1: the token form equals gyre.train.gspo.gspo_loss on padded sequences (value and gradient), whose
    ratio is the plain mean over each sequence's policy tokens: equal weights here."""
    logp, prox, _, weight, index, adv = random_batch(7, n_trees=5, per_tree=6)
    mask = (weight > 0).view(5, 6)
    equal = mask.double() / mask.sum(1, keepdim=True)
    leaf = logp.clone().requires_grad_()
    per_rollout, _ = corrected_gspo_loss(leaf, prox, equal.view(-1), index, adv, torch.ones_like(logp), 0.04,
                                         0.05)  # fmt: skip
    per_rollout.sum().backward()
    padded = logp.view(5, 6).clone().requires_grad_()
    loss, _ = gspo_loss(padded, prox.view(5, 6), mask, adv, torch.ones(5, dtype=torch.float64), 0.04, 0.05)
    loss.backward()
    assert float(per_rollout.detach().sum()) == pytest.approx(float(loss.detach()), abs=1e-12)
    assert leaf.grad.tolist() == pytest.approx(padded.grad.view(-1).tolist(), abs=1e-12)
    assert 0 < int((padded.grad.abs().sum(1) > 0).sum()) < 5  # clipped rollouts and unclipped ones


def test_hand_computed_weights_loss_and_metrics():
    """One rollout, three targets of weight 1/3 after a context root; proximal = logp (the first micro-batch of
    proximal=trainer: s = 1); engine logprobs off by log 4, log 0.8 and 0 nats."""
    prox = torch.tensor([0.0, -1.0, -2.0, -0.5], dtype=torch.float64)
    behav = prox - torch.tensor([0.0, math.log(4.0), math.log(0.8), 0.0], dtype=torch.float64)
    weight = torch.tensor([0.0, 1 / 3, 1 / 3, 1 / 3], dtype=torch.float64)
    index = torch.zeros(4, dtype=torch.long)
    adv = torch.tensor([2.0], dtype=torch.float64)
    tok = behaviour_ratio(prox, behav, weight, index, 1, "token")
    assert tok[1:].tolist() == pytest.approx([4.0, 0.8, 1.0])
    seq = behaviour_ratio(prox, behav, weight, index, 1, "sequence")
    assert seq[1:].tolist() == pytest.approx([(4.0 * 0.8) ** (1 / 3)] * 3)  # 1.4736
    assert correction_weights(tok, "tis", 2.0, 0.5, 2.0)[1:].tolist() == pytest.approx([2.0, 0.8, 1.0])
    assert correction_weights(tok, "mask", 2.0, 0.5, 2.0)[1:].tolist() == pytest.approx([0.0, 0.8, 1.0])
    assert correction_weights(seq, "mask", 2.0, 0.5, 1.4)[1:].tolist() == [0.0, 0.0, 0.0]  # MIS: the whole rollout
    for kind, expected in (("tis", -(2.0 + 0.8 + 1.0) / 3 * 2), ("mask", -(0.8 + 1.0) / 3 * 2)):
        c = correction_weights(tok, kind, 2.0, 0.5, 2.0)
        leaf = prox.clone().requires_grad_()
        per_rollout, s = corrected_gspo_loss(leaf, prox, weight, index, adv, c, 0.2, 0.2)
        per_rollout.sum().backward()
        assert float(s[0]) == 1.0 and float(per_rollout[0].detach()) == pytest.approx(expected)
        assert leaf.grad.tolist() == pytest.approx([0.0, *(-2.0 / 3 * float(x) for x in c[1:])])
    c = correction_weights(tok, "mask", 2.0, 0.5, 2.0)
    m = mismatch_metrics(prox, behav, weight, index, 1, tok, c, "mask", 2.0)
    k3 = [4 - 1 - math.log(4), 0.8 - 1 - math.log(0.8), 0.0]
    assert m["mismatch/kl_k3"] == pytest.approx(sum(k3) / 3)
    assert m["mismatch/masked_frac"] == pytest.approx(1 / 3) and m["mismatch/truncated_frac"] == 0.0
    assert m["mismatch/ratio_p50"] == pytest.approx(1.0)
    assert m["mismatch/ratio_p05"] == pytest.approx(0.8 + 0.1 * (1.0 - 0.8))  # linear interpolation, 3 values
    assert m["mismatch/seq_ratio_min"] == pytest.approx((4.0 * 0.8) ** (1 / 3))
    t = mismatch_metrics(prox, behav, weight, index, 1, tok, correction_weights(tok, "tis", 2.0, 0.5, 2.0), "tis", 2.0)
    assert t["mismatch/truncated_frac"] == pytest.approx(1 / 3) and t["mismatch/masked_frac"] == 0.0


def test_per_tree_mean_skips_trees_without_weight():
    values = torch.tensor([1.0, 3.0, 5.0])
    weight = torch.tensor([1.0, 3.0, 0.0])
    assert per_tree_mean(values, weight, torch.tensor([0, 0, 1]), 2).tolist() == [2.5, 0.0]


def test_a_correction_needs_the_trainer_as_proximal():
    with pytest.raises(ConfigValueError, match=r"rl\.mismatch\.proximal=trainer"):
        MismatchConfig(correction="tis")
    cfg = compose(["rl.mismatch.proximal=trainer", "rl.mismatch.correction=mask", "rl.mismatch.level=sequence",
                   "rl.mismatch.low=0.6"])  # fmt: skip
    assert (cfg.rl.mismatch.correction, cfg.rl.mismatch.level, cfg.rl.mismatch.low) == ("mask", "sequence", 0.6)
    with pytest.raises(ConfigValueError, match=r"rl\.mismatch\.correction"):
        compose(["rl.mismatch.correction=tis"])
    with pytest.raises(ConfigValueError, match=r"rl\.mismatch\.high"):
        compose(["rl.mismatch.high=0.9"])
    with pytest.raises(Exception, match="level"):
        compose(["rl.mismatch.level=rollout"])
