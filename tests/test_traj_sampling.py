import numpy as np
import pytest

from gyre.proxy.synthetic import RolloutShape, claude_code_like_rollout, make_record
from gyre.traj.build import build_tree
from gyre.traj.sampling import choose_paths, sample_tree
from gyre.traj.tree import CallInfo, TrajectoryTree

pytestmark = pytest.mark.unit


def rec(call_id, input_ids, output_ids, role="main", logprobs=None, spliced=()):
    return make_record(call_id, input_ids, output_ids, role, logprobs, list(spliced))


def leaf_calls(tree, leaves):
    """For each chosen path end, the ids of the calls whose leaf it is."""
    return [sorted(c.call_id for c in tree.calls if c.leaf == leaf) for leaf in leaves]


def branchy_rollout():
    """System prompt [1, 2]; a main thread; a retry; a compaction; a sub-agent; a side call."""
    main1 = rec(1, [1, 2, 3], [10, 11])
    retry = rec(2, [1, 2, 3, 10, 11, 4], [30], spliced=[(3, 2, 1)])  # dropped: dead branch
    main2 = rec(3, [1, 2, 3, 10, 11, 4], [12, 13, 14], spliced=[(3, 2, 1)])
    summary = rec(4, [1, 2, 3, 10, 11, 5], [20, 21], role="main_summary", spliced=[(3, 2, 1)])
    main3 = rec(5, [1, 2, 6, 20, 21], [15])  # the compacted thread: shares only the system prompt
    sub = rec(6, [50, 51], [60, 61, 62, 63, 64, 65, 66, 67], role="subagent")
    side = rec(7, [90], [91, 92], role="side")
    return [main1, retry, main2, summary, main3, sub, side]


def test_hand_built_linear_tree_is_one_path_weighted_by_its_policy_tokens():
    tree = TrajectoryTree(
        rollout_id="r",
        tokens=np.array([1, 2, 10, 11, 3, 12], np.int32),
        parent=np.array([-1, 0, 1, 2, 3, 4], np.int32),
        depth=np.arange(6, dtype=np.int32),
        policy=np.array([0, 0, 1, 1, 0, 1], bool),
        logprob=np.array([0, 0, -0.1, -0.2, 0, -0.3], np.float32),
        call_id=np.array([-1, -1, 1, 1, -1, 2], np.int64),
        role=np.zeros(6, np.uint8),
        calls=[CallInfo(1, "main", 3, 2, 2, "v", "stop", 0, 1), CallInfo(2, "main", 5, 5, 1, "v", "stop", 1, 2)],
    )
    s = sample_tree(tree)
    assert s.n_paths == 1 and s.source_index.tolist() == list(range(6))
    np.testing.assert_allclose(s.loss_weight, [0, 0, 1 / 3, 1 / 3, 0, 1 / 3], rtol=1e-6)
    assert [c.call_id for c in s.tree.calls] == [1, 2]


def test_role_priority_main_then_summary_then_subagent_and_side_left_out():
    tree = build_tree("r", branchy_rollout())
    leaves = choose_paths(tree, k=5)
    # main2's thread (3 new targets) first; the retry and the compacted thread tie (1 new target each):
    # the earlier call first. Then the summary, then the sub-agent though it holds the most targets;
    # never the side call (its output is context).
    assert leaf_calls(tree, leaves) == [[3], [2], [5], [4], [6]]
    assert leaf_calls(tree, choose_paths(tree, k=5, roles=("main",))) == [[3], [2], [5]]


def test_k_smaller_than_the_leaves_keeps_the_highest_priority_paths():
    tree = build_tree("r", branchy_rollout())
    s = sample_tree(tree, k=2)
    assert s.n_paths == 2
    assert leaf_calls(s.tree, s.path_leaves) == [[3], [2]]
    assert sorted(c.call_id for c in s.tree.calls) == [1, 2, 3]  # calls whose leaf is in the union
    s.tree.validate()
    assert np.all(s.tree.tokens == tree.tokens[s.source_index])


def test_a_summary_branch_ranks_as_a_summary_though_it_carries_uncovered_main_calls():
    main1 = rec(1, [1, 2], [10, 11, 12])
    summary = rec(2, [1, 2, 10, 11, 12, 3], [20], role="main_summary", spliced=[(2, 3, 1)])  # extends the thread
    main2 = rec(3, [1, 4, 20], [13])  # the compacted thread: one new target, fewer than the summary branch's 4
    sub = rec(4, [50], [60, 61, 62, 63, 64], role="subagent")
    tree = build_tree("r", [main1, summary, main2, sub])
    # main first: the later main call, then the summary branch (which trains main call 1), then the sub-agent
    assert leaf_calls(tree, choose_paths(tree, k=1)) == [[3]]
    assert leaf_calls(tree, choose_paths(tree, k=3)) == [[3], [2], [4]]
    s = sample_tree(tree, k=2)
    trained_calls = {int(c) for c in s.tree.call_id[s.loss_weight > 0]}
    assert trained_calls == {1, 2, 3}


def test_weights_sum_to_one_and_shared_targets_count_once():
    tree = build_tree("r", branchy_rollout())
    s = sample_tree(tree, k=5)
    assert s.loss_weight.sum() == pytest.approx(1.0, abs=1e-6)
    targets = s.tree.policy
    assert np.all(s.loss_weight[~targets] == 0)
    assert np.allclose(s.loss_weight[targets], 1 / targets.sum())
    # main1's reply [10, 11] lies on three chosen paths (main2, retry, summary) and is two targets, not six
    distinct = {int(i) for leaf in s.path_leaves for i in s.tree.path_to(int(leaf)) if s.tree.policy[i]}
    per_path = sum(int(s.tree.policy[s.tree.path_to(int(leaf))].sum()) for leaf in s.path_leaves)
    assert targets.sum() == len(distinct) == 2 + 1 + 3 + 2 + 1 + 8 < per_path


@pytest.mark.parametrize("k", [1, 2, 5, 50])
def test_a_rollouts_weight_does_not_depend_on_how_many_paths_it_gives(k):
    tree = build_tree("r", branchy_rollout())
    assert sample_tree(tree, k=k).loss_weight.sum() == pytest.approx(1.0, abs=1e-6)


def test_excluded_calls_do_not_make_paths():
    bad = rec(1, [1], [10, 11], logprobs=[-0.1])  # truncated
    tree = build_tree("r", [bad, rec(2, [5], [20], role="side")])
    s = sample_tree(tree)
    assert s.n_paths == 0 and s.tree.n_tokens == 0 and s.loss_weight.sum() == 0


def test_an_empty_rollout_samples_nothing():
    s = sample_tree(build_tree("r", []))
    assert s.n_paths == 0 and s.tree.n_tokens == 0 and s.loss_weight.shape == (0,)


def test_paths_without_new_targets_are_not_taken():
    c1 = rec(1, [1, 2], [10])
    c2 = rec(2, [1, 2, 10], [])  # adds no target: its path is a prefix of nothing new
    c3 = rec(3, [1, 3], [])
    tree = build_tree("r", [c1, c2, c3])
    assert leaf_calls(tree, choose_paths(tree)) == [[1, 2]]


def test_bad_k_or_roles_are_errors():
    tree = build_tree("r", [rec(1, [1], [2])])
    with pytest.raises(ValueError, match="at least one path"):
        choose_paths(tree, k=0)
    with pytest.raises(ValueError, match="unknown roles"):
        choose_paths(tree, roles=("planner",))
    with pytest.raises(ValueError, match="side calls are never trained"):
        choose_paths(tree, roles=("main", "side"))


@pytest.mark.parametrize("seed", range(10))
def test_sampled_tree_is_the_union_of_whole_chosen_paths(seed):
    shape = RolloutShape(
        n_calls=60, vocab=4, system_tokens=3, subagent_system_tokens=2, output_tokens=(0, 4),
        tool_result_tokens=(0, 4), context_limit=30, p_subagent=0.2, p_retry=0.3, p_side=0.1,
    )  # fmt: skip
    tree = build_tree("r0", claude_code_like_rollout(shape, seed=seed))
    s = sample_tree(tree, k=3)
    s.tree.validate()
    assert 1 <= s.n_paths <= 3
    union = set()
    for leaf in s.path_leaves:
        assert len(s.tree.leaves()) >= 1 and int(leaf) in set(s.tree.leaves().tolist())
        union |= {int(i) for i in s.tree.path_to(int(leaf))}
    assert union == set(range(s.tree.n_tokens))
    assert np.all(s.tree.depth == tree.depth[s.source_index])
    assert s.loss_weight.sum() == pytest.approx(1.0, abs=1e-5)
