import dataclasses

import numpy as np
import pytest

from gyre.proxy.synthetic import RolloutShape, claude_code_like_rollout, make_record
from gyre.traj.build import MissingCallError, build_tree
from gyre.traj.expand import expand_paths
from gyre.traj.sampling import sample_tree
from gyre.traj.tree import CONTEXT, ROLE_CODE, TreeError

pytestmark = pytest.mark.unit


def rec(call_id, input_ids, output_ids, role="main", logprobs=None, spliced=(), rollout_id="r"):
    return make_record(call_id, input_ids, output_ids, role, logprobs, list(spliced), rollout_id)


def assert_calls_recoverable(tree, records):
    tree.validate()
    by_id = {r.call_id: r for r in records}
    for info in tree.calls:
        r = by_id[info.call_id]
        path = tree.path_to(info.leaf)
        assert tree.tokens[path].tolist() == r.input_ids + r.output_ids
        assert tree.depth[path].tolist() == list(range(len(path)))
        if info.role == "side":  # a side call generates no target and claims none
            assert not np.any(tree.call_id == info.call_id)
        elif not info.excluded:  # every output token is a policy target (this call's or an earlier generator's)
            assert tree.policy[path[len(r.input_ids) :]].all()


def test_linear_conversation_stores_each_token_once_and_outputs_stay_policy():
    sys_, u1, u2 = [1, 2, 3], [4], [5, 6]
    c1 = rec(1, sys_ + u1, [10, 11])
    c2 = rec(2, sys_ + u1 + [10, 11] + u2, [12], spliced=[(4, 2, 1)])
    tree = build_tree("r", [c2, c1])
    assert tree.tokens.tolist() == [1, 2, 3, 4, 10, 11, 5, 6, 12]
    assert tree.parent.tolist() == [-1, 0, 1, 2, 3, 4, 5, 6, 7]
    assert tree.policy.tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 1]
    assert tree.call_id.tolist() == [CONTEXT] * 4 + [1, 1, CONTEXT, CONTEXT, 2]
    np.testing.assert_allclose(tree.logprob, [0, 0, 0, 0, -0.1, -0.2, 0, 0, -0.1], rtol=1e-6)
    assert [c.leaf for c in tree.calls] == [5, 8]
    assert all(c.trained and not c.excluded for c in tree.calls)
    assert_calls_recoverable(tree, [c1, c2])


def test_compaction_branches_after_the_shared_system_prompt():
    sys_ = [1, 2, 3]
    c1 = rec(1, sys_ + [4], [10])
    c2 = rec(2, sys_ + [4, 10, 5], [11], spliced=[(4, 1, 1)])
    summary = rec(3, sys_ + [4, 10, 6], [20, 21], role="main_summary", spliced=[(4, 1, 1)])
    c4 = rec(4, sys_ + [7, 20, 21, 8], [12], role="main")  # summary re-tokenized: context
    tree = build_tree("r", [c1, c2, summary, c4])
    assert_calls_recoverable(tree, [c1, c2, summary, c4])
    assert tree.n_tokens == 3 + 2 + 2 + 1 + 3 + 4
    branch = tree.path_to(tree.calls[3].leaf)
    assert tree.parent[branch[3]] == 2  # the new thread leaves the old one right after the system prompt
    assert not tree.policy[branch[4:6]].any()  # summary text in the new prompt is context there
    assert len(tree.leaves()) == 3
    assert tree.role[tree.path_to(tree.calls[2].leaf)[-2:]].tolist() == [ROLE_CODE["main_summary"]] * 2


def test_subagent_with_its_own_system_prompt_is_a_separate_root():
    c1 = rec(1, [1, 2, 3], [10])
    sub = rec(2, [50, 51, 52], [60], role="subagent")
    c3 = rec(3, [1, 2, 3, 10, 4], [11], spliced=[(3, 1, 1)])
    tree = build_tree("r", [c1, sub, c3])
    assert_calls_recoverable(tree, [c1, sub, c3])
    roots = np.flatnonzero(tree.parent < 0)
    assert tree.tokens[roots].tolist() == [1, 50]
    assert tree.role[tree.path_to(tree.calls[1].leaf)].tolist() == [ROLE_CODE["subagent"]] * 4


def test_retry_keeps_the_dropped_reply_as_a_dead_branch_sharing_its_common_start():
    c1 = rec(1, [1, 2], [10, 11, 12])
    retry = rec(2, [1, 2], [10, 13], logprobs=[-0.5, -0.6])
    c3 = rec(3, [1, 2, 10, 13, 4], [14], spliced=[(2, 2, 2)])
    tree = build_tree("r", [c1, retry, c3])
    assert_calls_recoverable(tree, [c1, retry, c3])
    assert tree.n_tokens == 2 + 3 + 1 + 2
    first = tree.path_to(tree.calls[0].leaf)
    assert tree.call_id[first[2]] == 1 and tree.logprob[first[2]] == pytest.approx(-0.1)  # first generator owns it
    assert tree.call_id[tree.calls[1].leaf] == 2
    assert len(tree.leaves()) == 2  # call 1's reply is a dead branch


def test_identical_retry_ends_on_the_same_leaf():
    c1, c2 = rec(1, [1, 2], [10]), rec(2, [1, 2], [10])
    tree = build_tree("r", [c1, c2])
    assert tree.n_tokens == 3 and tree.calls[0].leaf == tree.calls[1].leaf == 2
    assert tree.call_id[2] == 1


def test_generated_tokens_that_exist_as_context_become_policy_of_that_call():
    c1 = rec(1, [1, 2, 7, 8], [9])  # a prompt that already contains "7 8" after "1 2"
    c2 = rec(2, [1, 2], [7, 8], logprobs=[-1.0, -2.0])
    tree = build_tree("r", [c1, c2])
    assert_calls_recoverable(tree, [c1, c2])
    assert tree.policy.tolist() == [0, 0, 1, 1, 1]
    assert tree.call_id.tolist() == [CONTEXT, CONTEXT, 2, 2, 1]
    np.testing.assert_allclose(tree.logprob[2:4], [-1.0, -2.0])


def test_truncated_call_is_excluded_and_its_reply_kept_as_context():
    bad = rec(1, [1, 2], [10, 11], logprobs=[-0.1])
    c2 = rec(2, [1, 2, 10, 11, 3], [12], spliced=[(2, 2, 1)])
    tree = build_tree("r", [bad, c2])
    assert_calls_recoverable(tree, [bad, c2])
    info = tree.calls[0]
    assert not info.trained and "truncated" in info.excluded and "2 output ids but 1 logprobs" in info.excluded
    assert tree.policy.tolist() == [0, 0, 0, 0, 0, 1]
    assert tree.calls[1].trained


def test_non_finite_logprobs_exclude_the_call():
    tree = build_tree("r", [rec(1, [1], [2], logprobs=[float("nan")])])
    assert "non-finite" in tree.calls[0].excluded and not tree.policy.any()


def test_missing_spliced_source_is_an_error_but_a_gap_in_ids_is_fine():
    c1 = rec(1, [1], [10])
    c5 = rec(5, [1, 10, 2], [11], spliced=[(1, 1, 1)])
    build_tree("r", [c1, c5])
    with pytest.raises(MissingCallError, match="call 5 splices the output of call 1, which is not in the call log"):
        build_tree("r", [c5])


def test_spliced_span_that_is_not_the_source_output_is_an_error():
    c1 = rec(1, [1], [10])
    with pytest.raises(TreeError, match="not call 1's output ids"):
        build_tree("r", [c1, rec(2, [1, 99, 2], [11], spliced=[(1, 1, 1)])])
    with pytest.raises(TreeError, match="outside its 3 input ids"):
        build_tree("r", [c1, rec(2, [1, 10, 2], [11], spliced=[(2, 5, 1)])])


def test_unknown_role_is_excluded_and_recorded_as_side():
    tree = build_tree("r", [rec(1, [1], [10], role="planner"), rec(2, [1, 10, 2], [11], spliced=[(1, 1, 1)])])
    info = tree.calls[0]
    assert info.role == "side" and not info.trained and "unknown role 'planner'" in info.excluded
    assert tree.policy.tolist() == [0, 0, 0, 1]


def test_empty_input_is_an_error():
    with pytest.raises(TreeError, match="call 1 has no input ids"):
        build_tree("r", [rec(1, [], [10]), rec(2, [1], [11])])


def test_side_call_outputs_are_context_and_never_trained():
    tree = build_tree("r", [rec(1, [1], [10], role="side")])
    assert tree.policy.tolist() == [0, 0] and tree.call_id.tolist() == [CONTEXT, CONTEXT]
    assert tree.logprob.tolist() == [0, 0] and not tree.calls[0].trained and not tree.calls[0].excluded


def test_a_side_call_whose_prompt_prefixes_the_main_context_gives_it_no_target():
    # Title generation sends the first user turn; the main thread's context later runs through the same
    # tokens the side call answered with. Only main's own reply [9] may ever be a target.
    side = rec(1, [1, 2], [7, 8], role="side")
    main = rec(2, [1, 2, 7, 8, 3], [9])
    tree = build_tree("r", [side, main])
    assert tree.tokens.tolist() == [1, 2, 7, 8, 3, 9]
    assert tree.policy.tolist() == [0, 0, 0, 0, 0, 1] and tree.call_id.tolist() == [CONTEXT] * 5 + [2]
    s = sample_tree(tree)
    assert s.loss_weight.tolist() == [0, 0, 0, 0, 0, 1]


def test_a_side_call_never_claims_another_calls_tokens():
    # main's context [5, 6] (a tool result) is what the side call then generates: it stays context
    main = rec(1, [1, 2, 5, 6], [9])
    side = rec(2, [1, 2], [5, 6, 4], role="side")
    tree = build_tree("r", [main, side])
    assert tree.policy.tolist() == [0, 0, 0, 0, 1, 0] and tree.call_id.tolist() == [CONTEXT] * 4 + [1, CONTEXT]
    # and a main call that generates what a side call generated first claims it (main produced it too)
    tree = build_tree("r", [rec(1, [1, 2], [5, 6], role="side"), rec(2, [1, 2], [5, 6, 4])])
    assert tree.policy.tolist() == [0, 0, 1, 1, 1] and tree.call_id.tolist() == [CONTEXT, CONTEXT, 2, 2, 2]


def test_calls_of_another_rollout_or_repeated_ids_are_errors():
    with pytest.raises(TreeError, match="belongs to rollout 'x'"):
        build_tree("r", [rec(1, [1], [2], rollout_id="x")])
    with pytest.raises(TreeError, match="appears twice"):
        build_tree("r", [rec(1, [1], [2]), rec(1, [1], [3])])


def test_validate_rejects_a_corrupt_tree():
    tree = build_tree("r", [rec(1, [1, 2], [3]), rec(2, [1, 4], [5])])
    tree.validate()
    broken = dataclasses.replace(tree, parent=np.array([-1, 0, 1, 0, 4], np.int32))
    with pytest.raises(TreeError, match="not topological"):
        broken.validate()
    dup = dataclasses.replace(tree, tokens=np.array([1, 2, 3, 2, 5], np.int32))
    with pytest.raises(TreeError, match="same token"):
        dup.validate()


def test_expand_paths_gives_each_root_to_leaf_sequence():
    c1 = rec(1, [1, 2], [10, 11])
    c2 = rec(2, [1, 3], [12])
    tree = build_tree("r", [c1, c2])
    seqs = expand_paths(tree)
    assert [s.tokens.tolist() for s in seqs] == [[1, 2, 10, 11], [1, 3, 12]]
    assert [s.positions.tolist() for s in seqs] == [[0, 1, 2, 3], [0, 1, 2]]
    assert [s.policy.tolist() for s in seqs] == [[0, 0, 1, 1], [0, 0, 1]]
    np.testing.assert_allclose(seqs[0].logprob, [0, 0, -0.1, -0.2], rtol=1e-6)


def distinct_prefixes(records):
    return len({tuple(s[: i + 1]) for r in records for s in [r.input_ids + r.output_ids] for i in range(len(s))})


@pytest.mark.parametrize("seed", range(40))
def test_property_every_call_is_a_root_path_and_prefixes_are_stored_once(seed):
    rng = np.random.default_rng(seed)
    shape = RolloutShape(
        n_calls=int(rng.integers(1, 40)),
        vocab=int(rng.integers(2, 6)),  # tiny: accidental shared prefixes and re-generated context
        system_tokens=int(rng.integers(0, 4)),
        subagent_system_tokens=int(rng.integers(0, 3)),
        output_tokens=(0, 4),
        tool_result_tokens=(0, 4),
        context_limit=int(rng.integers(5, 40)),
        p_subagent=0.2,
        p_retry=0.3,
        p_side=0.1,
    )
    records = claude_code_like_rollout(shape, seed=seed)
    order = rng.permutation(len(records))
    tree = build_tree("r0", [records[i] for i in order])
    assert [c.call_id for c in tree.calls] == sorted(r.call_id for r in records)
    assert_calls_recoverable(tree, records)
    assert tree.n_tokens == distinct_prefixes(records)
    generated = np.zeros(tree.n_tokens, bool)  # policy == outputs of usable non-side calls, nothing else
    owner = np.full(tree.n_tokens, -1)
    for info, r in zip(tree.calls, sorted(records, key=lambda r: r.call_id), strict=True):
        if not info.excluded and info.role != "side":
            out = tree.path_to(info.leaf)[len(r.input_ids) :]
            owner[out[~generated[out]]] = info.call_id
            generated[out] = True
    assert tree.policy.tolist() == generated.tolist()
    assert tree.call_id[generated].tolist() == owner[generated].tolist()  # the first generator owns a token
