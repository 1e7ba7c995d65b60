"""A tree over the micro-batch budget, trained in segments, equals training it whole (fp32).

Logprobs within 1e-5; gradients of the GSPO loss (whose sequence-level ratio couples every segment of
the rollout) within 1e-5 relative, on random trees at budgets down to 1/20 of the tree and on the
recorded Claude Code session.
"""

import dataclasses
import gc
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gyre.config.schema import MismatchConfig, ModelConfig, TrainConfig
from gyre.pipeline import RLMicroBatch, tree_gspo_loss_fn
from gyre.proxy.call_log import read_call_log
from gyre.train import chunked_logprobs
from gyre.train import tree_attention as tree_attention_module
from gyre.train.megatron_trainer import MegatronTrainer
from gyre.train.sampling_logprobs import TokenSampling, sampled_token_logprobs
from gyre.train.split_tree import _Layout
from gyre.train.tree_attention import dense_tree_mask, plan_from_parents, tree_attention
from gyre.train.tree_pack import SplitTreeBatch, pack_forest, pack_trees, split_tree, weighted_token_loss
from gyre.traj.build import build_tree
from gyre.traj.sampling import sample_tree
from gyre.traj.tree import TrajectoryTree
from tests.test_tree_training import CFG, claude_like_tree, random_tree

pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*")]
RECORDING = Path(__file__).parent / "data" / "claude_code_calls.jsonl"


@pytest.fixture(scope="module")
def trainer() -> MegatronTrainer:
    torch.manual_seed(0)
    return MegatronTrainer(CFG, TrainConfig(num_threads=1))


def with_behaviour(
    trainer: MegatronTrainer, tree: TrajectoryTree, seed: int, truncated: bool = False
) -> tuple[TrajectoryTree, np.ndarray]:
    """Behaviour logprobs near the current policy's (ratios near 1, neither all clipped nor all 1) and
    per-token weights summing to 1, as bounded sampling gives."""
    mb = pack_forest([tree])
    mb.sampling = dataclasses.replace(mb.sampling, truncated=truncated)
    with torch.no_grad():
        logp = trainer.tree_token_logprobs(mb).numpy()
    rng = np.random.default_rng(seed)
    own = np.empty(tree.n_tokens, np.float32)
    own[mb.source_index.numpy()] = logp
    tree.logprob = np.where(tree.policy, own + rng.normal(0, 0.05, tree.n_tokens), 0).astype(np.float32)
    weight = tree.policy.astype(np.float32) / max(int(tree.policy.sum()), 1)
    return tree, weight


def grads_and_logp(trainer: MegatronTrainer, batch, loss_fn) -> tuple[torch.Tensor, torch.Tensor, dict]:
    trainer.zero_grad()
    mb = RLMicroBatch(batch, torch.tensor([0.7]), 1.0)
    metrics = trainer.forward_backward([mb], loss_fn)
    grads = torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters()])
    with torch.no_grad():
        logp = trainer.micro_batch_logprobs(batch)
    trainer.zero_grad()
    return grads, logp, metrics


def assert_split_equals_whole(
    trainer: MegatronTrainer, tree: TrajectoryTree, weight: np.ndarray, budgets, truncated: bool = False
) -> None:
    loss_fn = tree_gspo_loss_fn(0.02, 0.02)  # narrow clip: some trees clipped, some not
    whole = pack_forest([tree], [weight])
    whole.sampling = dataclasses.replace(whole.sampling, truncated=truncated)
    whole_g, whole_logp, whole_m = grads_and_logp(trainer, whole, loss_fn)
    assert whole_g.norm() > 0 or whole_m["clip_frac"] == 1.0
    for budget in budgets:
        split = split_tree(tree, budget, weight)
        split.sampling = dataclasses.replace(split.sampling, truncated=truncated)
        assert len(split.segments) >= tree.n_tokens // budget
        g, logp, m = grads_and_logp(trainer, split, loss_fn)
        assert torch.allclose(logp, whole_logp, atol=1e-5, rtol=0), (budget, float((logp - whole_logp).abs().max()))
        rel = float((g - whole_g).norm() / whole_g.norm().clamp(min=1e-30))
        assert rel < 1e-5, (budget, rel)
        assert m["ratio_mean"] == pytest.approx(whole_m["ratio_mean"], rel=1e-6)


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-flash", "unfused"])
@pytest.mark.parametrize("seed", range(3))
def test_segment_attention_over_a_given_root_path_equals_dense_attention(seed, fused, monkeypatch):
    """A segment's queries attend to the given root path in unmasked tiles merged by logsumexp (several key
    chunks, several runs where the segment leaves the path's subtrees) and to their own keys in masked blocks:
    outputs, the segment's gradients and the gradients added to the path's sinks equal dense masked attention."""
    if not fused:
        monkeypatch.setattr(tree_attention_module, "_CPU_FLASH", None)
    monkeypatch.setattr(tree_attention_module, "PREFIX_KEY_CHUNK", 5)
    monkeypatch.setattr(tree_attention_module, "DEFAULT_MASK_BUDGET", 35)  # unfused: 7-key tiles of 5 queries
    monkeypatch.setattr(tree_attention_module, "MAX_BLOCK", 5)
    rng = np.random.default_rng(seed)
    batch = split_tree(random_tree(rng, 40, max_segment=10), 1)
    lay = _Layout(batch)
    a = next(i for i in range(batch.n_tokens // 2, batch.n_tokens) if lay.depth[i] >= 12)
    b = min(batch.n_tokens, a + 60)
    path = lay.root_path(a)
    d = len(path)
    local = lay.segment_parents(a, b, d)
    plan = plan_from_parents(local, query_start=d, block_size=int(rng.integers(1, 9)))
    assert len(plan.prefix_runs) >= 2  # the segment leaves part of the path behind
    gen = torch.Generator().manual_seed(seed)
    n = len(local)
    q, k, v = (torch.randn(h, n, 8, generator=gen, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_tree_mask(local), scale=0.3, enable_gqa=True)[:, d:]
    kp, vp = k.detach()[:, :d].clone(), v.detach()[:, :d].clone()
    sinks = torch.zeros_like(kp), torch.zeros_like(vp)
    qs, ks, vs = (t.detach()[:, d:].clone().requires_grad_() for t in (q, k, v))
    out = tree_attention(qs, ks, vs, plan, 0.3, (kp, vp, *sinks))
    assert torch.allclose(out, ref, atol=1e-12)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad(out, (qs, ks, vs), g)
    ref_q, ref_k, ref_v = torch.autograd.grad(ref, (q, k, v), g)
    for got, want in zip(grads, (ref_q[:, d:], ref_k[:, d:], ref_v[:, d:]), strict=True):
        assert torch.allclose(got, want, atol=1e-10)
    assert torch.allclose(sinks[0], ref_k[:, :d], atol=1e-10) and torch.allclose(sinks[1], ref_v[:, :d], atol=1e-10)


@pytest.mark.parametrize("seed", range(3))
def test_split_random_trees_equal_the_whole_tree_down_to_a_twentieth(trainer, seed):
    rng = np.random.default_rng(seed)
    tree, weight = with_behaviour(trainer, random_tree(rng, 30, max_segment=14), seed)
    n = tree.n_tokens
    assert_split_equals_whole(trainer, tree, weight, [n // 2, n // 5, max(1, n // 20)])


def test_split_claude_like_tree_equals_the_whole_tree(trainer):
    rng = np.random.default_rng(7)
    tree, weight = with_behaviour(trainer, claude_like_tree(rng, system=200, turns=8, turn=(20, 60)), 7)
    assert_split_equals_whole(trainer, tree, weight, [tree.n_tokens // 20])


@pytest.mark.integration
@pytest.mark.parametrize("sampling", ["as_recorded", "mixed_truncated"])
def test_split_recorded_claude_code_session_equals_the_whole_tree(sampling):
    """mixed_truncated: calls at temperatures 0.7 and 1.6, every other one top-k truncated, scored under
    rl.logprob_distribution=truncated: each segment scores its tokens under their own call's distribution."""
    torch.set_num_threads(1)
    calls = read_call_log(RECORDING)
    if sampling == "mixed_truncated":
        calls = [
            dataclasses.replace(c, temperature=(0.7, 1.6)[i % 2], top_k=(-1, 40)[i % 2]) for i, c in enumerate(calls)
        ]
    sampled = sample_tree(build_tree(calls[0].rollout_id, calls), k=5)
    cfg = ModelConfig(vocab_size=int(sampled.tree.tokens.max()) + 1, hidden_size=32, num_layers=2,
                      num_attention_heads=2, num_query_groups=1, ffn_hidden_size=64,
                      max_position_embeddings=8192)  # fmt: skip
    torch.manual_seed(0)
    trainer = MegatronTrainer(cfg, TrainConfig(num_threads=1))
    tree, weight = with_behaviour(trainer, sampled.tree, 3, truncated=sampling == "mixed_truncated")
    assert len(tree.leaves()) >= 2
    if sampling == "mixed_truncated":
        assert {c.temperature for c in tree.calls} == {0.7, 1.6}
    assert_split_equals_whole(trainer, tree, weight, [tree.n_tokens // 20], truncated=sampling == "mixed_truncated")


def test_pack_trees_splits_a_tree_over_the_budget_and_packs_the_rest_whole():
    rng = np.random.default_rng(1)
    big, small = random_tree(rng, 30, name="big"), random_tree(rng, 3, name="small")
    budget = big.n_tokens // 3
    assert small.n_tokens <= budget < big.n_tokens
    batches = pack_trees([small, big], token_budget=budget)
    assert [type(b).__name__ for b in batches] == ["SplitTreeBatch", "TreeMicroBatch"]
    split = batches[0]
    assert isinstance(split, SplitTreeBatch) and split.rollout_ids == ["big"]
    assert all(b - a <= budget for a, b in split.segments) and split.segments[-1][1] == big.n_tokens
    whole = pack_forest([big])
    for name in ("tokens", "parent", "positions", "loss_weight", "source_index"):
        assert torch.equal(getattr(split, name), getattr(whole, name)), name


def test_a_split_tree_with_the_trainer_as_proximal_and_a_token_mask_equals_the_whole_tree(trainer):
    """rl.mismatch: the proximal logprobs of a split tree (its no-gradient pass) and the gradient of a token mask
    (not proportional to the loss weights: the second, exact pass) equal the whole tree's."""
    rng = np.random.default_rng(5)
    tree, weight = with_behaviour(trainer, random_tree(rng, 30, max_segment=14), 5)
    tree.logprob = np.where(tree.policy, tree.logprob + rng.normal(0, 0.6, tree.n_tokens), 0).astype(np.float32)
    mismatch = MismatchConfig(proximal="trainer", correction="mask", low=0.6, high=1.6)
    loss_fn = tree_gspo_loss_fn(0.02, 0.02, mismatch)
    whole_g, _, whole_m = grads_and_logp(trainer, pack_forest([tree], [weight]), loss_fn)
    assert 0.1 < whole_m["mismatch/masked_frac"] < 0.9 and whole_m["ratio_mean"] == 1.0
    split_g, _, split_m = grads_and_logp(trainer, split_tree(tree, max(1, tree.n_tokens // 10), weight), loss_fn)
    assert float((split_g - whole_g).norm() / whole_g.norm()) < 1e-5
    assert split_m["mismatch/masked_frac"] == whole_m["mismatch/masked_frac"]
    assert split_m["mismatch/kl_k3"] == pytest.approx(whole_m["mismatch/kl_k3"], rel=1e-4)


def test_a_loss_not_proportional_to_the_weights_and_earlier_gradients_are_exact(trainer):
    """A non-linear token loss takes the second, exact-g pass; a split tree adds to what earlier micro-batches left."""
    rng = np.random.default_rng(11)
    small, big = random_tree(rng, 4, name="small"), random_tree(rng, 25, name="big")

    def loss_fn(logp, mb):
        w = mb.loss_weight
        loss = (w * logp * logp).sum() + 0.3 * (w * logp).sum()
        return loss, {"loss": float(loss.detach())}

    def grads(batches):
        trainer.zero_grad()
        trainer.forward_backward(batches, loss_fn)
        g = torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters()])
        trainer.zero_grad()
        return g

    whole = grads([pack_forest([small]), pack_forest([big])])
    split = grads([pack_forest([small]), split_tree(big, max(1, big.n_tokens // 10))])
    assert float((split - whole).norm() / whole.norm()) < 1e-5


@pytest.mark.filterwarnings("ignore:.*reduce_op.*:FutureWarning")  # gc.get_objects meets a deprecated alias
def test_a_split_forward_backward_keeps_no_segment_tensor_alive(trainer):
    """Memory is set by one segment and the path, not by the number of segments: once the sweep is over,
    no tensor of any segment is alive (a segment's keys/values once were, held by an autograd cycle)."""
    rng = np.random.default_rng(5)
    tree = random_tree(rng, 30, max_segment=14)
    batch = split_tree(tree, max(1, tree.n_tokens // 10))

    def live_tensors() -> dict[int, tuple]:
        gc.collect()
        return {id(o): tuple(o.shape) for o in gc.get_objects() if torch.is_tensor(o)}

    trainer.zero_grad()
    trainer.forward_backward([batch], weighted_token_loss)  # megatron caches RoPE tables by length once
    trainer.zero_grad()
    before = live_tensors()
    trainer.forward_backward([batch], weighted_token_loss)
    trainer.zero_grad()
    new = [shape for i, shape in live_tensors().items() if i not in before]
    assert not new, new


@pytest.mark.parametrize("truncated", [False, True], ids=["tempered", "truncated"])
def test_logprobs_in_row_chunks_equal_those_of_the_whole_logits(trainer, monkeypatch, truncated):
    """TargetLogprobs (the logits made 7 rows at a time, checkpointed) gives the logprobs, and the gradients of
    the hidden states and the output weight, of sampled_token_logprobs on the whole [T, V] logits."""
    monkeypatch.setattr(chunked_logprobs, "MIN_CHUNK_ROWS", 1)
    model, rng = trainer.model, torch.Generator().manual_seed(3)
    n, t = 60, 50
    hidden = torch.randn(n, CFG.hidden_size, generator=rng)
    rows = torch.randint(0, n, (t,), generator=rng)
    targets = torch.randint(0, CFG.vocab_size, (t,), generator=rng)
    sampling = TokenSampling(
        torch.rand(t, generator=rng) + 0.5, torch.full((t,), 0.9), torch.full((t,), 20), torch.full((t,), 0.01),
        truncated,
    )  # fmt: skip
    g = torch.randn(t, generator=rng)

    def run(chunked: bool) -> tuple[torch.Tensor, ...]:
        h = hidden.clone().requires_grad_()
        model.zero_grad(set_to_none=True)
        head = chunked_logprobs.TargetLogprobs(model, chunk_elements=7 * CFG.vocab_size)
        logp = (
            head(h, rows, targets, sampling)
            if chunked
            else sampled_token_logprobs(head.logits(h)[rows], targets, sampling)
        )
        (g * logp).sum().backward()
        return logp.detach(), h.grad, model.output_layer.weight.grad.clone()

    for got, want in zip(run(True), run(False), strict=True):
        assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))
    model.zero_grad(set_to_none=True)
