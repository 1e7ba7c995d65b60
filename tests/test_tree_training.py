"""Tree-packed training is exact: per-token logprobs and gradients equal running each root-to-leaf path alone."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from gyre.config.schema import ModelConfig, TrainConfig
from gyre.train import tree_attention as tree_attention_module
from gyre.train.megatron_trainer import MegatronTrainer
from gyre.train.tree_attention import dense_tree_mask, plan_from_parents, tree_attention
from gyre.train.tree_pack import depth_first_order, pack_forest, pack_trees, weighted_token_loss
from gyre.traj.tree import TrajectoryTree

pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*")]

CFG = ModelConfig(
    vocab_size=61, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128
)


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


def make_tree(tokens, parent, name="t", policy=None) -> TrajectoryTree:
    tokens, parent = np.asarray(tokens, np.int32), np.asarray(parent, np.int32)
    n = len(tokens)
    depth = np.zeros(n, np.int32)
    for i in range(n):
        depth[i] = 0 if parent[i] < 0 else depth[parent[i]] + 1
    policy = (parent >= 0) if policy is None else np.asarray(policy, bool)
    return TrajectoryTree(
        name, tokens, parent, depth, policy, np.zeros(n, np.float32), np.full(n, -1), np.zeros(n, np.uint8)
    )


def random_tree(rng, n_segments, max_segment=12, vocab=CFG.vocab_size, name="t") -> TrajectoryTree:
    """Random-length segments, each branching off a random existing token (the first one is the root)."""
    tokens, parent = [], []
    for s in range(n_segments):
        p = -1 if s == 0 else int(rng.integers(0, len(tokens)))
        for _ in range(int(rng.integers(1, max_segment + 1))):
            tokens.append(int(rng.integers(0, vocab)))
            parent.append(p)
            p = len(tokens) - 1
    return make_tree(tokens, parent, name, policy=(rng.random(len(tokens)) < 0.6) & (np.asarray(parent) >= 0))


def claude_like_tree(rng, system=600, turns=12, turn=(40, 120), branches=4, name="cc") -> TrajectoryTree:
    """A long shared prefix, a main thread of many turns, dead retries and a few long side branches."""
    tokens = list(rng.integers(0, CFG.vocab_size, system))
    parent = [-1] + list(range(system - 1))
    main_end = system - 1
    for _ in range(turns):
        n = int(rng.integers(*turn))
        if rng.random() < 0.5:  # a dropped reply: a short dead branch off the current end
            k = len(tokens)
            tokens += list(rng.integers(0, CFG.vocab_size, 10))
            parent += [main_end] + list(range(k, k + 9))
        k = len(tokens)
        tokens += list(rng.integers(0, CFG.vocab_size, n))
        parent += [main_end] + list(range(k, k + n - 1))
        main_end = len(tokens) - 1
    for _ in range(branches):  # sub-agents / compactions branch off the prefix or mid-thread
        at = int(rng.integers(0, len(tokens)))
        n = int(rng.integers(*turn)) * 3
        k = len(tokens)
        tokens += list(rng.integers(0, CFG.vocab_size, n))
        parent += [at] + list(range(k, k + n - 1))
    return make_tree(tokens, parent, name)


def packed_position(mb, tree_k: int) -> dict[int, int]:
    sel = (mb.tree_index == tree_k).nonzero().squeeze(1)
    return {int(mb.source_index[i]): int(i) for i in sel}


# --- the attention kernel on its own -------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-flash-backward", "recompute-backward"])
@pytest.mark.parametrize("seed", range(4))
def test_tree_attention_equals_dense_masked_attention_forward_and_backward(seed, fused, monkeypatch):
    assert tree_attention_module._CPU_FLASH is not None, "this torch lacks the CPU flash-attention ops"
    if not fused:  # the path CUDA takes: public scaled_dot_product_attention, recomputed in backward
        monkeypatch.setattr(tree_attention_module, "_CPU_FLASH", None)
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, n_segments=int(rng.integers(1, 20)))
    perm = depth_first_order(tree.parent)
    inv = np.argsort(perm)
    parent = np.where(tree.parent[perm] >= 0, inv[np.maximum(tree.parent[perm], 0)], -1)
    plan = plan_from_parents(parent, block_size=int(rng.integers(1, 9)))
    assert torch.equal(plan.positions, torch.from_numpy(tree.depth[perm].astype(np.int64)))
    n = len(parent)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(h, n, 8, generator=gen, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    out = tree_attention(q, k, v, plan, 0.3)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_tree_mask(parent), scale=0.3, enable_gqa=True)
    assert torch.allclose(out, ref, atol=1e-12)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-10)


def test_plan_rejects_an_order_that_is_not_depth_first():
    # 0 -> 1, 0 -> 2, 1 -> 3: token 3 comes after its parent's sibling subtree started
    with pytest.raises(ValueError, match="depth-first"):
        plan_from_parents(np.array([-1, 0, 0, 1]))
    with pytest.raises(ValueError, match="before its child"):
        plan_from_parents(np.array([-1, 2, 0]))


def test_depth_first_order_puts_the_heaviest_branch_first_and_keeps_chains_contiguous():
    # root chain 0-1, light branch 2 (1 token) off 1, heavy branch 3-4-5 off 1
    tree = make_tree([5, 6, 7, 8, 9, 10], [-1, 0, 1, 1, 3, 4])
    assert depth_first_order(tree.parent).tolist() == [0, 1, 3, 4, 5, 2]


# --- the megatron-core trainer on tree micro-batches ---------------------------------------------


def test_tree_logprobs_equal_each_path_run_alone():
    trainer = MegatronTrainer(CFG, TrainConfig(num_threads=1))
    rng = np.random.default_rng(1)
    trees = [random_tree(rng, n_segments=int(rng.integers(1, 25)), name=f"r{i}") for i in range(5)]
    trees.append(claude_like_tree(rng, system=80, turns=6, turn=(5, 30), branches=3))
    batches = pack_trees(trees, token_budget=700, block_size=32)
    assert len(batches) > 1 and all(mb.n_tokens <= 700 for mb in batches)
    checked = 0
    with torch.no_grad():
        for mb in batches:
            logp = trainer.tree_token_logprobs(mb)
            assert logp.dtype == torch.float32 and logp.shape == (mb.n_tokens,)
            assert torch.all(logp[mb.parent < 0] == 0)
            for k, rid in enumerate(mb.rollout_ids):
                tree = next(t for t in trees if t.rollout_id == rid)
                at = packed_position(mb, k)
                for leaf in tree.leaves():
                    path = tree.path_to(int(leaf))
                    alone = trainer.token_logprobs(torch.as_tensor(tree.tokens[path], dtype=torch.long)[None])[0]
                    got = logp[[at[int(i)] for i in path[1:]]]
                    assert torch.allclose(got, alone, atol=1e-5, rtol=0), (rid, (got - alone).abs().max())
                    checked += len(path) - 1
    assert checked > 1000


def test_tree_loss_gradient_equals_sum_of_path_losses_counting_shared_tokens_once():
    rng = np.random.default_rng(2)
    tree = random_tree(rng, n_segments=15)
    weight = rng.random(tree.n_tokens).astype(np.float32) * (tree.parent >= 0)

    tree_tr = MegatronTrainer(CFG, TrainConfig(num_threads=1))
    mb = pack_forest([tree], [weight], block_size=16)
    tree_tr.zero_grad()
    loss, _ = weighted_token_loss(tree_tr.tree_token_logprobs(mb), mb)
    loss.backward()

    path_tr = MegatronTrainer(CFG, TrainConfig(num_threads=1))
    path_tr.zero_grad()
    claimed = np.zeros(tree.n_tokens, bool)
    path_total = 0.0
    for leaf in tree.leaves():
        path = tree.path_to(int(leaf))
        targets = path[1:]
        w = np.where(claimed[targets], 0.0, weight[targets])
        claimed[targets] = True
        logp = path_tr.token_logprobs(torch.as_tensor(tree.tokens[path], dtype=torch.long)[None])[0]
        path_loss = -(logp * torch.as_tensor(w, dtype=torch.float32)).sum()
        path_loss.backward()
        path_total += float(path_loss.detach())
    assert claimed[tree.parent >= 0].all()
    assert float(loss.detach()) == pytest.approx(path_total, rel=1e-5)
    for (name, a), b in zip(tree_tr.model.named_parameters(), path_tr.model.parameters(), strict=True):
        scale = b.grad.abs().max().item()
        assert (a.grad - b.grad).abs().max().item() <= 1e-4 * scale + 1e-7, name


def test_train_step_on_tree_micro_batches_lowers_the_weighted_loss():
    trainer = MegatronTrainer(CFG, TrainConfig(lr=3e-3, grad_clip=1.0, num_threads=1))
    rng = np.random.default_rng(3)
    batches = pack_trees([random_tree(rng, 10, name=f"r{i}") for i in range(3)], token_budget=200)
    losses = [trainer.train_step(batches, weighted_token_loss)["weighted_nll"] for _ in range(5)]
    assert losses[-1] < 0.8 * losses[0], losses
    assert trainer.step == 5


class LargestTensor(TorchDispatchMode):
    """Records the shape of every tensor an aten op returns (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out

    def square_ones(self, n: int) -> list[tuple[int, ...]]:
        return [s for s in self.shapes if sum(d >= n for d in s) >= 2]


def test_a_tree_of_thousands_of_tokens_trains_without_an_n_by_n_tensor():
    trainer = MegatronTrainer(CFG, TrainConfig(num_threads=1))
    tree = claude_like_tree(np.random.default_rng(4), system=1500, turns=10, turn=(60, 140), branches=3)
    mb = pack_forest([tree])
    n = mb.n_tokens
    assert n > 3000 and len(mb.attention.blocks) > 1
    watch = LargestTensor()
    with watch:
        loss, _ = weighted_token_loss(trainer.tree_token_logprobs(mb), mb)
        loss.backward()
    assert watch.square_ones(n) == [] and max(np.prod(s) for s in watch.shapes) < n * n // 2
    assert all(p.grad is not None for p in trainer.model.parameters())
    # the same watch does see the N x N scores of a plain dense forward
    with LargestTensor() as dense:
        trainer.token_logprobs(torch.randint(0, CFG.vocab_size, (1, 300)))
    assert dense.square_ones(300)


# --- packing -------------------------------------------------------------------------------------


def test_pack_trees_respects_the_budget_and_maps_tokens_back():
    rng = np.random.default_rng(5)
    trees = [random_tree(rng, 8, name=f"r{i}") for i in range(6)]
    batches = pack_trees(trees, token_budget=150)
    seen = {}
    for mb in batches:
        assert mb.n_tokens <= 150
        for k, rid in enumerate(mb.rollout_ids):
            tree = next(t for t in trees if t.rollout_id == rid)
            at = packed_position(mb, k)
            assert sorted(at) == list(range(tree.n_tokens))
            idx = torch.tensor([at[i] for i in range(tree.n_tokens)])
            assert torch.equal(mb.tokens[0, idx], torch.as_tensor(tree.tokens, dtype=torch.long))
            assert torch.equal(mb.positions[idx], torch.as_tensor(tree.depth, dtype=torch.long))
            parent_src = torch.where(mb.parent[idx] >= 0, mb.source_index[mb.parent[idx].clamp(min=0)], -1)
            assert torch.equal(parent_src, torch.as_tensor(tree.parent, dtype=torch.long))
            assert torch.equal(mb.loss_weight[idx], torch.as_tensor(tree.policy, dtype=torch.float32))
            seen[rid] = True
    assert len(seen) == len(trees)


def test_pack_trees_refuses_bad_input_with_a_clear_error():
    tree = make_tree([1, 2, 3], [-1, 0, 1])
    with pytest.raises(ValueError, match="token_budget must be positive"):
        pack_trees([tree], token_budget=0)
    with pytest.raises(ValueError, match="over the maximum"):
        pack_trees([tree], token_budget=10, max_len=2)
    with pytest.raises(ValueError, match="root"):
        pack_forest([tree], [np.array([1.0, 1.0, 1.0])])
    bad_depth = make_tree([1, 2, 3], [-1, 0, 1])
    bad_depth.depth[2] = 5
    with pytest.raises(ValueError, match="depth"):
        pack_forest([bad_depth])
