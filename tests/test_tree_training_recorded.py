"""Tree training on a real Claude Code recording: tests/data/claude_code_calls.jsonl (tools/record_claude_code.py).

The calls of a real session (main thread, compaction summary, sub-agent and its summary) become one
prefix-shared tree; its tree-packed logprobs must equal each root-to-leaf path run alone (fp32, 1e-5).
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from gyre.config.schema import ModelConfig, TrainConfig
from gyre.proxy.call_log import CallRecord, read_call_log
from gyre.train.megatron_trainer import MegatronTrainer
from gyre.train.tree_pack import pack_trees
from gyre.traj.build import build_tree
from gyre.traj.sampling import sample_tree

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*")]
RECORDING = Path(__file__).parent / "data" / "claude_code_calls.jsonl"


def recorded_calls() -> list[CallRecord]:
    return read_call_log(RECORDING)


def test_recorded_session_builds_one_tree_with_every_role_and_every_call_recoverable():
    calls = recorded_calls()
    tree = build_tree(calls[0].rollout_id, calls)
    roles = {c.role for c in tree.calls}
    assert {"main", "main_summary", "subagent", "subagent_summary"} <= roles
    for call, info in zip(sorted(calls, key=lambda c: c.call_id), tree.calls, strict=True):
        path = tree.path_to(info.leaf)
        assert tree.tokens[path].tolist() == call.input_ids + call.output_ids
    recorded_tokens = sum(len(c.input_ids) + len(c.output_ids) for c in calls)
    assert tree.n_tokens < recorded_tokens / 3  # shared prefixes stored once


def test_tree_logprobs_on_the_recorded_session_equal_each_path_alone():
    torch.set_num_threads(1)
    calls = recorded_calls()
    tree = sample_tree(build_tree(calls[0].rollout_id, calls), k=5).tree
    vocab = int(tree.tokens.max()) + 1
    cfg = ModelConfig(vocab_size=vocab, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=128, max_position_embeddings=8192)  # fmt: skip
    trainer = MegatronTrainer(cfg, TrainConfig(num_threads=1))
    (mb,) = pack_trees([tree], token_budget=tree.n_tokens)
    pos = {int(s): i for i, s in enumerate(mb.source_index)}
    with torch.no_grad():
        logp = trainer.tree_token_logprobs(mb)
        for leaf in tree.leaves():
            path = tree.path_to(int(leaf))
            alone = trainer.token_logprobs(torch.as_tensor(tree.tokens[path], dtype=torch.long)[None])[0]
            got = logp[[pos[int(i)] for i in path[1:]]]
            assert torch.allclose(got, alone, atol=1e-5, rtol=0), (int(leaf), float((got - alone).abs().max()))
    assert len(tree.leaves()) >= 2 and np.asarray(tree.policy).sum() > 0
