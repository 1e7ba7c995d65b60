"""The real Codex CLI (npm `@openai/codex`, pinned) against the proxy's `/v1/responses`, offline, with a real
embedded engine behind it (fixtures from test_proxy): `codex exec` completes a session and every call it
made is in the call log, with its role."""

from __future__ import annotations

import subprocess

import pytest
import torch
from test_proxy import running_proxy, tokenizer  # noqa: F401

from gyre.config.schema import ModelConfig
from gyre.engine.launcher import start_engine
from gyre.harness.codex import CODEX_VERSION, codex_bin, codex_env, codex_exec_args, responses_base_url
from gyre.model.hf_io import save_hf_checkpoint
from gyre.model.llama import LlamaForCausalLM

CONTEXT = 8192  # Codex's first request with the short instructions below: ~4.5k tokens of the test tokenizer
INSTRUCTIONS = "You are a coding agent. Use exec_command to run shell commands in the workspace."


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tokenizer):  # noqa: F811
    """An untrained tiny model with room for Codex's prompt: what it answers is text, which ends the turn."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("codex_model")
    tokenizer.save(root / "tok")
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, num_layers=2, num_attention_heads=4,
                      num_query_groups=2, ffn_hidden_size=128, max_position_embeddings=CONTEXT)  # fmt: skip
    torch.manual_seed(0)
    ckpt = save_hf_checkpoint(root / "ckpt", LlamaForCausalLM(cfg).state_dict(), cfg, root / "tok")
    process = start_engine(ckpt, max_context_tokens=CONTEXT)
    try:
        yield process
    finally:
        process.stop()


@pytest.mark.integration
def test_codex_exec_completes_a_session_through_the_proxy(tokenizer, engine, tmp_path):  # noqa: F811
    assert codex_bin().exists(), f"Codex CLI {CODEX_VERSION} missing: bash tools/setup_env.sh"
    workspace, home = tmp_path / "ws", tmp_path / "codex_home"
    workspace.mkdir()
    home.mkdir()
    (tmp_path / "instructions.md").write_text(INSTRUCTIONS)
    env = codex_env(home, "dummy")
    with running_proxy(tokenizer, [engine.url], max_output_tokens=16, max_context_tokens=CONTEXT) as proxy:
        base = responses_base_url(proxy.url, "codex")
        done = subprocess.run(
            [*codex_exec_args(base, workspace, "gyre-policy", tmp_path / "instructions.md"), "Write 9 into out_3.txt"],
            env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        records = proxy.call_log.for_rollout("codex")
    print(done.stdout[-3000:], done.stderr[-3000:])
    assert done.returncode == 0, done.stderr[-3000:]
    assert records and all(r.api == "responses" for r in records)
    assert {r.role for r in records} <= {"main", "side"} and records[0].role == "main"
    assert records[-1].content.strip() in done.stdout  # Codex printed the policy's last answer
