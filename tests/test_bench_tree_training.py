"""The token accounting of tools/bench_tree_training.py on a hand-built rollout and on the recording."""

import pytest

from gyre.proxy.call_log import read_call_log
from gyre.proxy.synthetic import RolloutShape, make_record
from gyre.traj.build import build_tree
from tools.bench_tree_training import (
    RECORDING,
    UNBOUNDED,
    recorded_shape,
    recorded_structure,
    thread_stats,
    token_counts,
)

pytestmark = pytest.mark.unit


def test_tree_path_and_call_tokens_of_a_hand_built_rollout():
    first = make_record(1, [1, 2, 3], [4])
    retry = make_record(2, [1, 2, 3], [5])  # same prompt again: a dead branch
    second = make_record(3, [1, 2, 3, 4, 6], [7], spliced=[(3, 1, 1)])
    tree = build_tree("r", [first, retry, second])
    # tree 1 2 3 {4 6 7 | 5}: 7 tokens; paths [1 2 3 4 6 7] + [1 2 3 5]; calls 4 + 4 + 6 tokens;
    # attention pairs: depths 0-5 and 3 -> 21 + 4 in the tree, 21 + 10 as paths
    assert token_counts(tree, UNBOUNDED) == (2, 7, 10, 14, 25, 31)
    assert token_counts(tree, 1) == (1, 6, 6, 10, 21, 21)  # the retry's branch is left out


def test_recorded_structure_reads_what_the_threads_share():
    lines = recorded_structure(read_call_log(RECORDING))
    counts = dict(reversed(part.split(" ")) for part in lines[0].split(", "))
    assert counts.keys() == {"main", "main_summary", "subagent", "subagent_summary"} and int(counts["main"]) > 1
    assert any(line.startswith("subagent: first prompt") for line in lines)
    assert sum("after compaction: shares" in line for line in lines) == 2


def test_the_synthetic_shape_takes_the_recorded_sub_agent_to_main_system_prompt_ratio():
    calls = read_call_log(RECORDING)
    stats = thread_stats(calls)
    main, sub = stats["main"]["system"], stats["subagent"]["system"]
    assert 0 < sub < main < stats["main"]["first"]  # both compacted threads kept their system prompt and tools
    shape = recorded_shape(calls)
    assert shape.subagent_system_tokens == round(shape.system_tokens * sub / main)
    no_compaction = [c for c in calls if c.role in ("main", "subagent")][:3]
    assert recorded_shape(no_compaction) == RolloutShape()
