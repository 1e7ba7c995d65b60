from dataclasses import dataclass

import pytest
import torch

from gyre.train.rl_batch import ScoredRollout, build_micro_batches, rollout_advantages
from gyre.traj.paths import build_paths

pytestmark = pytest.mark.unit


@dataclass
class Call:
    call_id: int
    input_ids: list
    output_ids: list
    output_logprobs: list


def test_linear_conversation_becomes_one_path_with_outputs_as_policy_tokens():
    c0 = Call(0, [1, 2, 3], [10, 11], [-0.1, -0.2])
    c1 = Call(1, [1, 2, 3, 10, 11, 4, 5], [12], [-0.3])
    (path,) = build_paths([c1, c0])
    assert path.tokens == [1, 2, 3, 10, 11, 4, 5, 12]
    assert path.policy_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert path.behaviour_logprobs == [0, 0, 0, -0.1, -0.2, 0, 0, -0.3]
    assert path.call_ids == [0, 1]


def test_a_call_that_extends_no_path_starts_a_new_one():
    c0 = Call(0, [1, 2], [10], [-0.1])
    c1 = Call(1, [1, 2], [11], [-0.2])  # a retry of the same turn: a second branch
    c2 = Call(2, [7], [12], [-0.3])  # compaction: a fresh context
    paths = build_paths([c0, c1, c2])
    assert [p.tokens for p in paths] == [[1, 2, 10], [1, 2, 11], [7, 12]]


def test_truncated_call_record_is_an_error():
    with pytest.raises(ValueError, match="truncated"):
        build_paths([Call(0, [1], [10, 11], [-0.1])])


def test_failed_evaluations_are_excluded_not_zero():
    p = build_paths([Call(0, [1], [10], [-0.1])])
    rollouts = [
        ScoredRollout("a", 0, 1.0, p),
        ScoredRollout("b", 0, 0.0, p),
        ScoredRollout("c", 0, None, p),  # evaluation failed
    ]
    adv = rollout_advantages(rollouts)
    assert set(adv) == {"a", "b"}
    assert adv["a"] > 0 > adv["b"]


def test_micro_batches_respect_budget_and_weights_sum_to_one():
    def path(n):
        return build_paths([Call(0, list(range(1, n)), [99], [-0.5])])

    rollouts = [ScoredRollout(f"r{i}", i // 4, float(i % 2), path(5 + i)) for i in range(8)]
    batches = build_micro_batches(rollouts, token_budget=24, pad_id=0)
    assert all(b.tokens.numel() <= 24 or b.tokens.shape[0] == 1 for b in batches)
    total = sum(float(b.seq_weight.sum()) for b in batches)
    assert total == pytest.approx(1.0)
    b = batches[0]
    # the target-aligned mask marks the one generated token of each path
    assert torch.equal(b.policy_mask.sum(dim=1), torch.ones(b.tokens.shape[0]))
    assert float(b.old_logprobs.sum()) == pytest.approx(-0.5 * b.tokens.shape[0])


def test_groups_without_signal_produce_no_batches():
    p = build_paths([Call(0, [1], [10], [-0.1])])
    assert build_micro_batches([ScoredRollout("a", 0, 1.0, p), ScoredRollout("b", 0, 1.0, p)], 100, 0) == []
