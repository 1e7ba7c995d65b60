"""The real Codex CLI (npm `@openai/codex`, pinned) as `harness.kind=codex`: the runner starts `codex exec` in the
bwrap sandbox against the proxy's `/v1/responses`, offline, with a real embedded engine behind it, on a built-in
task and on a Harbor example task, and each workspace is graded by its task's checker.

The policy is a tiny Llama trained for a few seconds on one Codex demonstration (gyre/harness/formats.py), so
that it calls exec_command and the CLI runs the command and sends its output back: call k+1 of a rollout then
holds call k's prompt and output ids verbatim (the proxy splices the ids it generated instead of re-tokenizing
what Codex re-sent).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from gyre.config.schema import HarnessConfig, ModelConfig, ProxyConfig, TaskConfig
from gyre.engine.launcher import start_engine
from gyre.harness.codex import CODEX_VERSION, EventTally, codex_bin, codex_config, responses_base_url
from gyre.harness.kinds import harness_spec
from gyre.harness.runner import run_rollout
from gyre.model.chat_template import GENERATION_PROMPT
from gyre.model.hf_io import save_hf_checkpoint
from gyre.model.llama import LlamaForCausalLM
from gyre.model.tokenizer import Tokenizer
from gyre.proxy.call_log import CallLog
from gyre.proxy.keys import RolloutKeys
from gyre.proxy.server import ProxyServer
from gyre.tasks.harbor import load_harbor_task
from gyre.tasks.suite import sample_tasks
from gyre.warm_start import encode_conversation

ROOT = Path(__file__).resolve().parents[1]
HARBOR_TASK = ROOT / "examples" / "tasks" / "harbor" / "write-value"
CONTEXT = 4096
TRAIN_STEPS = 300


def train_policy(root: Path, task) -> Path:
    """A tiny Llama that has learnt one Codex session by heart: exec_command writing the task's file, then Done."""
    codex = harness_spec("codex")
    texts = [json.dumps(codex.demonstration(t).messages) for t in sample_tasks(["write_value"], 40, seed=1)]
    tok = Tokenizer.train(texts, vocab_size=512)
    tok.save(root / "tok")
    ids, mask = encode_conversation(*codex.demonstration(task), tok)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, num_layers=2, num_attention_heads=4,
                      num_query_groups=2, ffn_hidden_size=128, max_position_embeddings=CONTEXT)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    seq, weights = torch.tensor([ids]), torch.tensor(mask[1:], dtype=torch.float)
    for _ in range(TRAIN_STEPS):
        logits = model(seq[:, :-1], torch.arange(seq.shape[1] - 1)[None])[0][0]
        loss = (torch.nn.functional.cross_entropy(logits, seq[0, 1:], reduction="none") * weights).sum() / weights.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return save_hf_checkpoint(root / "ckpt", model.state_dict(), cfg, root / "tok")


@pytest.mark.unit
def test_codex_config_points_at_the_proxy_and_reads_its_event_stream():
    config = codex_config("http://127.0.0.1:9/rollout/r/v1", bare=True)
    assert config["model_providers.gyre.wire_api"] == '"responses"' and config["include_environment_context"] == "false"
    assert config["check_for_update_on_startup"] == "false" and config["analytics.enabled"] == "false"
    assert responses_base_url("http://h:1/v1", "r7") == "http://h:1/rollout/r7/v1"
    tally = EventTally()
    for event in (
        {"type": "item.completed", "item": {"type": "command_execution", "exit_code": 0}},
        {"type": "item.completed", "item": {"type": "agent_message", "text": "Done."}},
        {"type": "turn.completed", "usage": {}},
    ):
        tally.read(json.dumps(event))
    tally.read("not json")
    assert (tally.commands, tally.messages, tally.completed, tally.errors) == (1, ["Done."], True, [])


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    assert codex_bin().exists(), f"Codex CLI {CODEX_VERSION} missing: bash tools/setup_env.sh"
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("codex")
    (task,) = sample_tasks(["write_value"], 1, seed=0)
    engine = start_engine(train_policy(root, task), max_context_tokens=CONTEXT, log_path=root / "engine.log")
    keys = RolloutKeys()
    server = ProxyServer(Tokenizer.load(root / "tok"), [engine.url],
                         ProxyConfig(max_context_tokens=CONTEXT, max_output_tokens=48, default_max_tokens=48,
                                     sampling_seed=0),  # Codex sends no seed: the test samples the same tokens every run
                         CallLog(root / "calls.jsonl"), keys=keys)  # fmt: skip
    server.start()
    yield server, keys, root, task
    server.stop()
    engine.stop()


@pytest.mark.integration
def test_codex_runs_builtin_and_harbor_tasks_and_splices_its_outputs(proxy):
    server, keys, root, builtin = proxy
    harness = HarnessConfig(kind="codex", bare=True, max_turns=3, timeout_s=120.0)
    for name, task in (("builtin", builtin), ("harbor", load_harbor_task(HARBOR_TASK))):
        outcome = asyncio.run(
            run_rollout(task, f"cx-{name}", server.url, root / name, harness, TaskConfig(), keys=keys)
        )
        assert not outcome.timed_out and outcome.stop_reason in ("completed", "max_turns"), outcome.stderr_tail
        assert outcome.grade.status == "ok" and outcome.grade.score is not None, outcome.grade  # graded by its checker
        calls = server.call_log.for_rollout(f"cx-{name}")
        assert calls and all(c.api == "responses" and c.role == "main" for c in calls)
        assert task.prompt in Tokenizer.load(root / "tok").decode(calls[0].input_ids)
    assert outcome.grade.checks and {c["name"] for c in outcome.grade.checks} == {"exists", "content"}
    calls = server.call_log.for_rollout("cx-builtin")
    tok = Tokenizer.load(root / "tok")  # the CLI's first request in the sandbox is the warm start's, token for token
    ids, _ = encode_conversation(*harness_spec("codex").first_request(builtin, bare=True), tok)
    assert calls[0].input_ids == ids + tok.encode(GENERATION_PROMPT), tok.decode(calls[0].input_ids)
    assert len(calls) >= 2 and calls[0].tool_calls and calls[0].tool_calls[0]["name"] == "exec_command"
    for k, after in zip(calls, calls[1:], strict=False):  # call k+1 holds call k's prompt and output ids verbatim
        assert after.input_ids[: len(k.input_ids) + len(k.output_ids)] == k.input_ids + k.output_ids
        assert after.retokenized_turns == 0 and after.spliced
