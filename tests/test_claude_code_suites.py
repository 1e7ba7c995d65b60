"""Claude Code for real (the pinned `claude` CLI, offline, in the bwrap sandbox) on a Harbor task and on a
SWE-bench instance: the CLI is told the task's prompt and nothing of its hidden tests, works in the task's
workspace (a git repository at base_commit for SWE-bench), and the result is graded by the task's own
checker in the grading sandbox.

The policy is the tiny Llama of tools/record_claude_code.py, trained only a few steps: its replies are
noise, so this tests the plumbing (prompt, workspace, endpoint, grading), not what the model does.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from gyre.config.schema import HarnessConfig, ProxyConfig, TaskConfig
from gyre.engine.launcher import start_engine
from gyre.harness.claude_code import claude_bin
from gyre.harness.runner import run_rollout
from gyre.model.tokenizer import Tokenizer
from gyre.proxy.call_log import CallLog
from gyre.proxy.keys import RolloutKeys
from gyre.proxy.server import ProxyServer
from gyre.tasks.harbor import load_harbor_task
from gyre.tasks.swebench import load_swebench_tasks
from tools.record_claude_code import CONTEXT_TOKENS, build_policy

ROOT = Path(__file__).resolve().parents[1]
HARBOR_TASK = ROOT / "examples" / "tasks" / "harbor" / "write-value"
SWEBENCH = ROOT / "examples" / "tasks" / "swebench" / "instances.jsonl"


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    claude_bin()  # fails with what to run when the CLI is not installed
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("claude_suites")
    engine = start_engine(build_policy(root / "policy", steps=20), max_context_tokens=CONTEXT_TOKENS,
                          log_path=root / "engine.log")  # fmt: skip
    keys = RolloutKeys()
    server = ProxyServer(
        Tokenizer.load(root / "policy" / "tok"),
        [engine.url],
        ProxyConfig(max_context_tokens=CONTEXT_TOKENS, max_output_tokens=16),
        CallLog(root / "calls.jsonl"),
        keys=keys,
    )
    server.start()
    yield server, keys, root
    server.stop()
    engine.stop()


def tasks():
    (swe,) = [t for t in load_swebench_tasks(SWEBENCH) if t.task_id == "gyre-examples__notes-1"]
    return {"harbor": load_harbor_task(HARBOR_TASK), "swebench": swe}


@pytest.mark.integration
@pytest.mark.parametrize("fmt", ["harbor", "swebench"])
def test_claude_code_runs_on_the_task_format(fmt, proxy):
    server, keys, root = proxy
    task = tasks()[fmt]
    harness = HarnessConfig(kind="claude_code", max_turns=2, timeout_s=300.0)
    outcome = asyncio.run(
        run_rollout(task, f"cc-{fmt}", server.url, root / fmt, harness, TaskConfig(), keys=keys)
    )  # in the default sandbox (bwrap)
    assert not outcome.timed_out and outcome.stop_reason not in ("api_error", "no_result"), outcome.stderr_tail
    assert outcome.grade.status == "ok" and outcome.grade.score is not None, outcome.grade  # graded by its checker
    names = {c["name"] for c in outcome.grade.checks}
    assert names == ({"exists", "content"} if fmt == "harbor" else {
        "FAIL_TO_PASS: tests.test_note.TestNote.test_value",
        "PASS_TO_PASS: tests.test_note.TestNote.test_missing_is_empty"})  # fmt: skip
    calls = server.call_log.for_rollout(f"cc-{fmt}")
    assert calls, "Claude Code made no model call through the proxy"
    tok = Tokenizer.load(root / "policy" / "tok")
    prompt = tok.decode(calls[0].input_ids)
    assert task.prompt in prompt  # the task's prompt reached the model ...
    hidden = "Two named scores" if fmt == "harbor" else "test_missing_is_empty"
    assert hidden not in prompt  # ... and nothing of its tests
    workspace = root / fmt / "workspace"
    assert not (workspace / "tests" / "test.sh").exists()
    if fmt == "swebench":
        assert (workspace / ".git").is_dir() and "def test_value" not in (
            workspace / "tests" / "test_note.py"
        ).read_text()
