"""Train/inference mismatch: GSPO with a behaviour correction, on tree micro-batches, as pure tensor functions.

The engine that sampled a token (SGLang, bf16, its own kernels) and the trainer give it different
probabilities. Three logprobs per sampled token:
  behaviour  [N]  the engine's, recorded with the call (the shard's `logprob`)
  proximal   [N]  GSPO's old policy: the engine's (rl.mismatch.proximal=engine) or the trainer's under the
                  weights before this step's update (proximal=trainer, a no-grad forward)
  logp       [N]  the trainer's under the current weights, with gradient
Flat layout of a tree micro-batch: N packed tokens, `weight` [N] the loss weight of each target (0 on
context and roots; a sampled tree's weights sum to 1), `tree_index` [N] the rollout of each token,
advantages [R] per rollout.

Behaviour ratio rho = pi_proximal / pi_behaviour, detached:
  token level      rho_t = exp(proximal_t - behaviour_t)
  sequence level   rho_r = exp(sum_t w_t (proximal_t - behaviour_t) / sum_t w_t): the weighted geometric mean
                   over the rollout's trained targets (shared prefixes once), the same length normalisation
                   as GSPO's own ratio (AReaL's `apply_rejection_sampling` does the same for its ratio metric;
                   verl's `rollout_is=sequence` uses the plain product, which over a tree of thousands of
                   tokens is 0 or inf)
Correction weight c (per token; at sequence level every token of a rollout has its rollout's):
  none  c = 1
  tis   c = min(rho, cap)                        verl verl/trainer/ppo/rollout_corr_helper.py
                                                 (compute_rollout_correction_weights), slime
                                                 slime/backends/megatron_utils/loss.py (vanilla_tis_function)
  mask  c = rho if low <= rho <= high else 0     slime loss.py (icepop_function), AReaL
                                                 areal/utils/functional/functional.py (apply_rejection_sampling,
                                                 action=mask): IcePop; at sequence level, MIS
GSPO with the correction, token form (verl verl/trainer/ppo/core_algos.py, compute_policy_loss_gspo, which
multiplies the same per-token loss by rollout_is_weights):
  K_r      = r's targets with c > 0 (masked tokens leave the ratio, as verl's and AReaL's updated loss mask)
  s_r      = exp( sum_{t in K_r} w_t (logp_t - proximal_t) / sum_{t in K_r} w_t )
  s_{r,t}  = sg(s_r) * exp(logp_t - sg(logp_t))       (value s_r; gradient s_r * d logp_t)
  L_r      = - sum_t (w_t / sum_t w_t) * c_t * min(s_{r,t} A_r, clip(s_{r,t}, 1 - eps_low, 1 + eps_high) A_r)
The denominator is all of r's target weight, masked tokens included (slime keeps its per-rollout totals,
AReaL its original token count), so masking removes loss rather than reweighting the rest. With c = 1, L_r
and its gradient are GSPO's: -min(s_r A_r, clip(s_r) A_r).
"""

from __future__ import annotations

import torch

TIS, MASK, NONE = "tis", "mask", "none"
TOKEN, SEQUENCE = "token", "sequence"


def per_tree_mean(values: torch.Tensor, weight: torch.Tensor, tree_index: torch.Tensor, n_trees: int) -> torch.Tensor:
    """[N] x2, [N] -> [n_trees]: each tree's weight-averaged value (0 for a tree with no weight)."""
    num = values.new_zeros(n_trees).index_add(0, tree_index, values * weight)
    den = values.new_zeros(n_trees).index_add(0, tree_index, weight.to(values.dtype))
    return torch.where(den > 0, num / den.clamp(min=1e-30), torch.zeros_like(num))


def behaviour_ratio(
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    weight: torch.Tensor,
    tree_index: torch.Tensor,
    n_trees: int,
    level: str,
) -> torch.Tensor:
    """[N]: rho of each token, pi_proximal / pi_behaviour: its own (token) or its rollout's (sequence), detached."""
    log_ratio = (proximal - behaviour).detach()
    if level == TOKEN:
        return log_ratio.exp()
    if level == SEQUENCE:
        return per_tree_mean(log_ratio, weight, tree_index, n_trees).exp()[tree_index]
    raise ValueError(f"rl.mismatch.level={level!r}: choose token or sequence")


def correction_weights(ratio: torch.Tensor, correction: str, cap: float, low: float, high: float) -> torch.Tensor:
    """[N] rho -> [N] c, the weight of each token's loss (detached)."""
    ratio = ratio.detach()
    if correction == NONE:
        return torch.ones_like(ratio)
    if correction == TIS:
        return ratio.clamp(max=cap)
    if correction == MASK:
        return torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))
    raise ValueError(f"rl.mismatch.correction={correction!r}: choose none, tis or mask")


def corrected_gspo_loss(
    logp: torch.Tensor,
    proximal: torch.Tensor,
    weight: torch.Tensor,
    tree_index: torch.Tensor,
    advantages: torch.Tensor,
    correction: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L [R] each rollout's loss, s [R] its GSPO ratio, detached) for the formula in the module docstring."""
    n_trees = advantages.shape[0]
    weight = weight.to(logp.dtype)
    correction = correction.detach().to(logp.dtype)
    kept = weight * (correction > 0)
    log_s = per_tree_mean(logp - proximal, kept, tree_index, n_trees).detach()
    s_t = torch.exp(log_s[tree_index] + logp - logp.detach())
    adv_t = advantages.to(logp.dtype)[tree_index]
    surrogate = torch.minimum(s_t * adv_t, s_t.clamp(1.0 - eps_low, 1.0 + eps_high) * adv_t)
    total = logp.new_zeros(n_trees).index_add(0, tree_index, weight)
    share = weight / total.clamp(min=1e-30)[tree_index]
    per_rollout = -logp.new_zeros(n_trees).index_add(0, tree_index, share * correction * surrogate)
    return per_rollout, log_s.exp()


def mismatch_metrics(
    trainer: torch.Tensor,
    behaviour: torch.Tensor,
    weight: torch.Tensor,
    tree_index: torch.Tensor,
    n_trees: int,
    ratio: torch.Tensor,
    correction: torch.Tensor,
    kind: str,
    cap: float,
) -> dict[str, float]:
    """Diagnostics over the trained targets (weight > 0), each counted once.

    kl_k3: mean of rho - 1 - log rho with rho = pi_trainer / pi_behaviour, an estimate of KL(engine || trainer)
    from the engine's samples (verl's compute_offpolicy_metrics `k3_kl`); ratio_pNN: quantiles of the token
    ratio; seq_ratio_min/max: of the rollouts' geometric-mean ratios; masked_frac: targets with c = 0;
    truncated_frac: targets whose ratio (at the correction's level) was cut to cap.
    """
    targets = weight > 0
    if not bool(targets.any()):
        return {}
    log_rho = (trainer - behaviour).detach().double()
    token_log = log_rho[targets]
    k3 = token_log.exp() - 1.0 - token_log
    quantiles = torch.quantile(token_log.exp(), token_log.new_tensor([0.05, 0.5, 0.95]))
    has = torch.zeros(n_trees, dtype=torch.bool, device=weight.device).index_fill(0, tree_index[targets], True)
    seq = per_tree_mean(log_rho, weight.double(), tree_index, n_trees).exp()[has]
    return {
        "mismatch/kl_k3": float(k3.mean()),
        "mismatch/ratio_p05": float(quantiles[0]),
        "mismatch/ratio_p50": float(quantiles[1]),
        "mismatch/ratio_p95": float(quantiles[2]),
        "mismatch/seq_ratio_min": float(seq.min()),
        "mismatch/seq_ratio_max": float(seq.max()),
        "mismatch/masked_frac": float((correction[targets] == 0).double().mean()),
        "mismatch/truncated_frac": float((ratio[targets] > cap).double().mean()) if kind == TIS else 0.0,
    }
