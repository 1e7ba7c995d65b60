"""Claude Code for real: the pinned `claude` CLI, offline, against the proxy and the embedded engine.

One recorded session (tools/record_claude_code.py) on a built-in task: the main thread runs until
the proxy's forced context limit makes Claude Code compact, then a `/delegate` follow-up runs a forked
sub-agent until it compacts too. The Agent-tool path (x-claude-code-agent-id header) is covered by
a request sequence in test_anthropic_api.py: a tiny model does not choose that tool.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from gyre.harness.claude_code import anthropic_base_url, claude_bin, claude_env, result_summary, user_lines
from gyre.proxy.call_log import CallRecord, read_call_log
from gyre.proxy.roles import ROLES
from tools.record_claude_code import DEFAULT_OUT, Recording, off_loopback, record_session

THREADS = re.compile(r"^(main )+main_summary (main )+(subagent )+subagent_summary (subagent )+$")


# ---------------------------------------------------------------- harness wrapper (unit)


@pytest.mark.unit
def test_offline_environment_and_base_url(tmp_path):
    base = {"PATH": "/bin", "ANTHROPIC_AUTH_TOKEN": "secret", "https_proxy": "http://x", "CLAUDE_CODE_X": "1"}
    env = claude_env("http://127.0.0.1:9/v1", "r7", tmp_path, base)
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9/rollout/r7" and env["HOME"] == str(tmp_path)
    assert "ANTHROPIC_AUTH_TOKEN" not in env and "https_proxy" not in env and env["CLAUDE_CODE_X"] == "1"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert anthropic_base_url("http://h:1/rollout/a/v1", "b") == "http://h:1/rollout/a"
    lines = [json.loads(line) for line in user_lines(["do it", "/delegate do it"]).splitlines()]
    assert [m["message"]["content"] for m in lines] == ["do it", "/delegate do it"]


@pytest.mark.unit
def test_result_lines_become_the_runner_result():
    ok = {"type": "result", "is_error": False, "num_turns": 3, "stop_reason": "end_turn", "api_error_status": None}
    api = {"type": "result", "is_error": True, "num_turns": 1, "api_error_status": 400, "result": "Prompt is too long"}
    turns = {"type": "result", "is_error": True, "subtype": "error_max_turns", "num_turns": 9, "result": ""}
    text = lambda *rs: "\n".join(["not json", *(json.dumps(r) for r in rs)])  # noqa: E731
    assert result_summary(text(ok, ok), 0) | {"claude": None} == {
        "turns": 6, "stop_reason": "end_turn", "errors": [], "claude": None,
    }  # fmt: skip
    assert result_summary(text(ok, api), 1)["stop_reason"] == "api_error"  # attributed from the endpoint's record
    assert result_summary(text(turns), 1)["stop_reason"] == "error_max_turns"  # the policy's doing: graded
    assert result_summary("", 1)["stop_reason"] == "api_error"


@pytest.mark.unit
def test_off_loopback_flags_only_foreign_addresses(tmp_path):
    trace = tmp_path / "t"
    trace.write_text(
        '1 connect(3, {sa_family=AF_INET, sin_port=htons(80), sin_addr=inet_addr("127.0.0.1")}, 16) = 0\n'
        '1 connect(4, {sa_family=AF_UNIX, sun_path="/var/run/nscd/socket"}, 110) = -1 ENOENT\n'
        '1 connect(5, {sa_family=AF_INET6, sin6_port=htons(443), inet_pton(AF_INET6, "::1", &sin6_addr)}, 28) = 0\n'
        '2 sendto(6, "x", 1, 0, {sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("8.8.8.8")}, 16) = 1\n'
    )
    assert [line[:9] for line in off_loopback(trace)] == ["2 sendto("]


@pytest.mark.unit
def test_saved_recording_is_a_consistent_call_log():
    """tests/data/claude_code_calls.jsonl (regenerate: python -m tools.record_claude_code)."""
    assert DEFAULT_OUT.stat().st_size < 2 << 20
    records = read_call_log(DEFAULT_OUT)
    assert THREADS.match("".join(f"{r.role} " for r in records)) and {r.role for r in records} <= set(ROLES)
    check_splices(records)


def check_splices(records: list[CallRecord]) -> None:
    by_id = {r.call_id: r for r in records}
    for r in records:
        assert r.retokenized_turns == 0, f"call {r.call_id} re-tokenized a reply the proxy produced"
        for span in r.spliced:
            source = by_id[span.source_call_id]
            assert (
                source.call_id < r.call_id and r.input_ids[span.start : span.start + span.length] == source.output_ids
            )


def visible(reply: CallRecord) -> bool:
    return bool(reply.content.strip() or reply.tool_calls)


def assert_retried_with_a_nudge(prev: CallRecord, nxt: CallRecord) -> None:
    """Claude Code answers a reply with nothing to show (the policy ended its turn at once) by sending the same
    prompt again with "[Your previous response had no visible output. Please continue ...]" appended to its last
    user message: the prompt up to the end of that message, longer, then the same generation prompt."""
    end = prev.output_ids[-1]  # the turn's end token, which also closed the last user message
    tail = len(prev.input_ids) - max(i for i, t in enumerate(prev.input_ids) if t == end)
    assert len(nxt.input_ids) > len(prev.input_ids) and nxt.input_ids[-tail:] == prev.input_ids[-tail:]
    assert nxt.input_ids[: len(prev.input_ids) - tail] == prev.input_ids[:-tail]


# ---------------------------------------------------------------- the real CLI (integration)


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> Recording:
    claude_bin()  # fails with what to run when the CLI is not installed
    torch.set_num_threads(1)
    return record_session(tmp_path_factory.mktemp("claude_code"))


@pytest.mark.integration
def test_session_runs_offline_and_is_graded(recording):
    outcome = recording.outcome
    assert outcome is not None and not outcome.timed_out, outcome.stderr_tail
    assert outcome.stop_reason not in ("api_error", "no_result") and outcome.errors == [], outcome.stderr_tail
    assert outcome.grade.status == "ok" and outcome.turns >= 10  # graded from the workspace, not excluded
    assert 'inet_addr("127.0.0.1")' in recording.net_trace.read_text()  # the trace saw the proxy connection ...
    assert off_loopback(recording.net_trace) == []  # ... and nothing else


@pytest.mark.integration
def test_roles_threads_and_compactions(recording):
    records = recording.records
    roles = "".join(f"{r.role} " for r in records)
    assert THREADS.match(roles), roles
    assert all(r.api == "anthropic" and r.finish_reason in ("stop", "length") for r in records)
    for thread in ("main", "subagent"):
        calls = [r for r in records if r.role == thread]
        (summary,) = [r for r in records if r.role == f"{thread}_summary"]
        before = [r for r in calls if r.call_id < summary.call_id]
        after = [r for r in calls if r.call_id > summary.call_id]
        # Each turn extends the previous prompt (or retries it after a reply with nothing to show); the limit
        # was forced from the first prompt on.
        for prev, nxt in zip(before, before[1:], strict=False):
            if not visible(prev):
                assert_retried_with_a_nudge(prev, nxt)
                continue
            assert nxt.input_ids[: len(prev.input_ids)] == prev.input_ids
            assert nxt.input_ids[len(prev.input_ids) : len(prev.input_ids) + len(prev.output_ids)] == prev.output_ids
        limit = recording.limits[thread]
        assert before[-1].prompt_tokens <= limit and summary.prompt_tokens <= limit
        assert summary.call_id == recording.lifted_after[thread]
        # Compaction breaks the prefix: the summary and the new thread share the system prompt only.
        assert after and after[0].input_ids[: len(before[-1].input_ids)] != before[-1].input_ids
        assert summary.input_ids[:2000] == before[0].input_ids[:2000] == after[0].input_ids[:2000]


@pytest.mark.integration
def test_resent_replies_are_spliced_as_recorded_tokens(recording):
    records = recording.records
    check_splices(records)
    main = [r for r in records if r.role == "main"]
    # each turn resends every earlier reply that had something to show
    assert [len(r.spliced) for r in main[:5]] == [sum(map(visible, main[:i])) for i in range(5)]
    assert sum(len(r.spliced) for r in records) > 100


@pytest.mark.integration
def test_claude_code_accounts_the_reported_usage(recording):
    """usage.input_tokens is the exact prompt length: Claude Code's totals equal the records'."""
    results = json.loads((Path(recording.outcome.workdir) / "harness" / "result.json").read_text())["claude"]
    (model_usage,) = results[-1]["modelUsage"].values()  # cumulative over the session, compactions included
    assert model_usage["inputTokens"] == sum(r.prompt_tokens for r in recording.records)
    assert model_usage["outputTokens"] == sum(len(r.output_ids) for r in recording.records)
    first = [r for r in recording.records if r.role == "main"]
    assert results[0]["usage"]["input_tokens"] == sum(r.prompt_tokens for r in first)
    assert [json.loads(line)["call_id"] for line in recording.calls_jsonl.read_text().splitlines()] == [
        r.call_id for r in recording.records
    ]
