"""The Anthropic Messages API of the proxy: request conversion, reply shapes, errors, roles, and end to
end with the official `anthropic` client against real embedded engines (fixtures from test_proxy)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import anthropic
import pytest
from test_proxy import MEMO_ARGS, MEMO_MESSAGES, TOOLS, engines, free_port, model_dir, running_proxy, tokenizer  # noqa: F401

from gyre.model.chat_template import render_segments
from gyre.proxy.anthropic_api import (
    convert_messages,
    openai_tool_id,
    parse_messages_request,
    reply_blocks,
    sse_events,
    tool_use_id,
)
from gyre.proxy.call_log import CallLog
from gyre.proxy.errors import anthropic_status_and_body as error_status_and_body
from gyre.proxy.errors import context_length_exceeded, engine_unavailable
from gyre.proxy.roles import ROLES, call_role
from gyre.proxy.tito import TitoRenderer

A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip
A_SYSTEM = MEMO_MESSAGES[0]["content"]
A_MESSAGES = [{"role": "user", "content": MEMO_MESSAGES[1]["content"]}]
GREEDY = {"temperature": 0}  # the client dropped the argument; the API still takes it
CC_HEADERS = {"User-Agent": "claude-cli/2.1.197 (external, sdk-cli)", "x-app": "cli"}
SUMMARY_PROMPT = (
    "CRITICAL: Respond with TEXT ONLY. ... Your task is to create a detailed summary of the conversation so far"
)


# ---------------------------------------------------------------- conversion (unit)


@pytest.mark.unit
def test_claude_code_shaped_request_converts_and_ignores_unknown_fields():
    body = {
        "model": "claude-opus-4-8",
        "max_tokens": 64000,
        "stream": True,
        "system": [{"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "\nYou are an interactive agent."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>x</system-reminder>"},
                                         {"type": "text", "text": "Fix it", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "Available agent types: ..."},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "gyre-call-1"},
                                              {"type": "text", "text": "Look."},
                                              {"type": "tool_use", "id": "toolu_1_0", "name": "Bash",
                                               "input": {"command": "ls"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1_0",
                                          "content": [{"type": "text", "text": "a.txt"}, {"type": "image"}]},
                                         {"type": "text", "text": "go on"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "plain",
                                          "is_error": True}]},
        ],
        "tools": [{"name": "Bash", "description": "Run.\nMore.", "input_schema": {"type": "object"}}],
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "u"},
        "frobnicate": 1,
    }  # fmt: skip
    req = parse_messages_request(body, "gyre-policy")
    assert req.model == "claude-opus-4-8" and req.stream and req.params.max_tokens == 64000
    assert req.tool_names == ["Bash"] and req.system_text.endswith("interactive agent.")
    assert req.messages == [
        {"role": "system", "content": "You are a Claude agent.\nYou are an interactive agent."},
        {"role": "user", "content": "<system-reminder>x</system-reminder>Fix it"},
        {"role": "system", "content": "Available agent types: ..."},
        {"role": "assistant", "content": "<think>hm</think>Look.",
         "tool_calls": [{"id": "call_1_0", "type": "function", "function": {"name": "Bash", "arguments": {"command": "ls"}}}]},
        {"role": "tool", "tool_call_id": "call_1_0", "content": "a.txt[image]"},
        {"role": "user", "content": "go on"},
        {"role": "tool", "tool_call_id": "toolu_x", "content": "plain"},
    ]  # fmt: skip
    render_segments(req.messages, req.tools)  # the template accepts every converted message
    assert req.user_text == "<system-reminder>x</system-reminder>Fix it\ngo on\n"  # tool results aside


@pytest.mark.unit
@pytest.mark.parametrize(
    "body, needle",
    [
        ({"messages": []}, "non-empty"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
        ({"messages": [{"role": "user", "content": 3}]}, "content"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "stop_sequences": "x"}, "stop_sequences"),
    ],
)
def test_bad_requests_are_rejected(body, needle):
    with pytest.raises(Exception) as info:
        parse_messages_request(body, "m")
    status, err = error_status_and_body(info.value)
    assert status == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert needle in err["error"]["message"]


@pytest.mark.unit
def test_errors_have_anthropic_shape():
    assert error_status_and_body(context_length_exceeded(4000, 5000)) == (
        400,
        {"type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long: 5000 tokens > 4000 maximum"}},
    )  # fmt: skip
    status, body = error_status_and_body(engine_unavailable("no engine"))
    assert status == 529 and body["error"]["type"] == "overloaded_error"


@pytest.mark.unit
def test_reply_blocks_and_sse_events_reassemble():
    calls = [{"name": "Write", "arguments": {"file_path": "a", "content": "x" * 1500}}]
    blocks = reply_blocks("<think>plan</think>Now.", calls, ["call_7_0"], "gyre-call-7")
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"] and blocks[2]["id"] == "toolu_7_0"
    assert openai_tool_id(tool_use_id("call_7_0")) == "call_7_0"
    use = {"input_tokens": 9, "output_tokens": 4, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    events = sse_events("msg_1", "m", blocks, "tool_use", None, use)
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    rebuilt: dict[int, dict] = {}
    for name, data in events:
        if name == "content_block_start":
            rebuilt[data["index"]] = dict(data["content_block"], _json="")
        elif name == "content_block_delta":
            block, d = rebuilt[data["index"]], data["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature"}.get(d["type"])
            if key:
                block[key] += d[key]
            else:
                block["_json"] += d["partial_json"]
    for block in rebuilt.values():
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["_json"])
        del block["_json"]
    assert list(rebuilt.values()) == blocks
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use" and events[-2][1]["usage"]["input_tokens"] == 9


@pytest.mark.unit
def test_resent_reply_splices_by_tool_use_id_and_by_text(tokenizer):  # noqa: F811
    from test_proxy import make_record

    log = CallLog()
    text_call = '{"name": "write_file", "arguments": {"path": "out_3.txt", "content": "9"}}'
    rec = make_record(tokenizer, log, "r", f"<think>x</think>Hi.<tool_call>{text_call}</tool_call><|im_end|>")
    plain = make_record(tokenizer, log, "r", "Just text.<|im_end|>")
    resent = reply_blocks(rec.content, rec.tool_calls, rec.tool_call_ids, "sig")
    resent[-1]["input"] = dict(reversed(resent[-1]["input"].items()))  # Claude Code reorders keys
    messages = convert_messages(
        "sys",
        [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": resent},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": resent[-1]["id"], "content": "ok"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Just text."}]},
            {"role": "user", "content": "more"},
        ],
    )
    out = TitoRenderer(tokenizer, log).render("r", messages, TOOLS)
    assert [s.source_call_id for s in out.spliced] == [rec.call_id, plain.call_id] and out.retokenized_turns == 0
    for span, source in zip(out.spliced, (rec, plain), strict=True):
        assert out.input_ids[span.start : span.start + span.length] == source.output_ids


@pytest.mark.unit
def test_roles_from_claude_code_signals():
    def role(headers=CC_HEADERS, system="You are an interactive agent", last="do it", tools=True):
        return call_role(headers, system, f"earlier\n{last}", tools)

    sub = {**CC_HEADERS, "x-claude-code-agent-id": "a0123456789abcdef"}
    assert role() == "main" and role(headers={}, tools=False) == "main"  # a plain API client
    assert role(last=SUMMARY_PROMPT) == "main_summary"
    assert role(last=f"{SUMMARY_PROMPT}\nOutput token limit hit. Resume directly") == "main_summary"
    assert role(headers=sub) == "subagent" and role(headers=sub, last=SUMMARY_PROMPT) == "subagent_summary"
    assert role(system="You are an agent for Claude Code, Anthropic's official CLI") == "subagent"
    assert role(last="Generate a concise, sentence-case title for this", tools=False) == "side"
    assert role(tools=False) == "side"
    assert set(ROLES) == {"main", "main_summary", "subagent", "subagent_summary", "side"}


# ---------------------------------------------------------------- end to end: real engines, official client


@pytest.fixture(scope="module")
def proxy(tokenizer, engines):  # noqa: F811
    with running_proxy(tokenizer, [engines[0].url]) as server:
        yield server


def client_for(base: str, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=60, **kw)


@pytest.mark.integration
def test_tool_use_reply_matches_the_record_and_count_tokens(proxy):
    client = client_for(f"{proxy.url}/rollout/plain")
    msg = client.messages.create(
        model="claude-whatever", system=A_SYSTEM, messages=A_MESSAGES, tools=A_TOOLS, max_tokens=64, extra_body=GREEDY
    )
    (record,) = proxy.call_log.for_rollout("plain")
    assert msg.model == "claude-whatever" and msg.role == "assistant" and msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["text", "tool_use"] and msg.content[0].text == "I will write it."
    assert msg.content[1].name == "write_file" and msg.content[1].input == MEMO_ARGS
    assert msg.content[1].id == f"toolu_{record.call_id}_0"
    assert msg.usage.input_tokens == record.prompt_tokens == len(record.input_ids)
    assert msg.usage.output_tokens == len(record.output_ids)
    assert record.api == "anthropic" and record.role == "main" and record.tool_names == ["write_file"]
    counted = client.messages.count_tokens(model="m", system=A_SYSTEM, messages=A_MESSAGES, tools=A_TOOLS)
    assert counted.input_tokens == record.prompt_tokens and len(proxy.call_log.for_rollout("plain")) == 1


@pytest.mark.integration
def test_streamed_beta_reply_then_resent_turn_is_spliced(proxy):
    client = client_for(f"{proxy.url}/rollout/stream")
    with client.beta.messages.stream(  # POST /v1/messages?beta=true, as Claude Code sends
        model="m", system=[{"type": "text", "text": A_SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=A_MESSAGES, tools=A_TOOLS, max_tokens=64, extra_body=GREEDY, betas=["claude-code-20250219"],
    ) as stream:  # fmt: skip
        events = [e.type for e in stream]
        first = stream.get_final_message()
    assert "content_block_delta" in events and events[-1] == "message_stop"
    (rec1,) = proxy.call_log.for_rollout("stream")
    assert first.stop_reason == "tool_use" and first.content[1].input == MEMO_ARGS
    assert first.usage.input_tokens == rec1.prompt_tokens and first.usage.output_tokens == len(rec1.output_ids)
    tool_use = first.content[1].model_dump()
    tool_use["input"] = dict(reversed(tool_use["input"].items()))
    history = [
        *A_MESSAGES,
        {"role": "assistant", "content": [first.content[0].model_dump(), tool_use]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": tool_use["id"], "content": "wrote 1 byte"}],
        },
    ]
    second = client.messages.create(model="m", system=A_SYSTEM, messages=history, tools=A_TOOLS, max_tokens=4)
    rec2 = proxy.call_log.for_rollout("stream")[1]
    (span,) = rec2.spliced
    assert (
        span.source_call_id == rec1.call_id and rec2.input_ids[span.start : span.start + span.length] == rec1.output_ids
    )
    assert rec2.input_ids[: len(rec1.input_ids)] == rec1.input_ids and rec2.retokenized_turns == 0
    assert second.usage.input_tokens == rec2.prompt_tokens


@pytest.mark.integration
def test_forced_context_limit_answers_prompt_too_long(proxy):
    client = client_for(f"{proxy.url}/rollout/small")
    n = client.messages.count_tokens(model="m", system=A_SYSTEM, messages=A_MESSAGES, tools=A_TOOLS).input_tokens
    proxy.force_context_limit("small", n - 1)
    try:
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(model="m", system=A_SYSTEM, messages=A_MESSAGES, tools=A_TOOLS, max_tokens=8)
        assert info.value.body == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": f"prompt is too long: {n} tokens > {n - 1} maximum"},
        }
        assert info.value.response.headers["x-gyre-context-limit"] == f"{n} > {n - 1}"  # the endpoint's record
        other = client_for(f"{proxy.url}/rollout/other")  # the limit is per rollout
        other.messages.create(model="m", system=A_SYSTEM, messages=A_MESSAGES, tools=A_TOOLS, max_tokens=2)
    finally:
        proxy.force_context_limit("small", None)
    client.messages.create(model="m", system=A_SYSTEM, messages=A_MESSAGES, tools=A_TOOLS, max_tokens=2)
    assert proxy.call_log.for_rollout("small")[0].prompt_tokens == n


@pytest.mark.integration
def test_engine_down_is_529_overloaded_and_bad_json_is_400(tokenizer):  # noqa: F811
    with running_proxy(tokenizer, [f"http://127.0.0.1:{free_port()}"], max_output_tokens=3) as server:
        with pytest.raises(anthropic.APIStatusError) as info:
            client_for(server.url).messages.create(model="m", messages=A_MESSAGES, max_tokens=2)
        assert info.value.status_code == 529 and info.value.body["error"]["type"] == "overloaded_error"
        req = urllib.request.Request(f"{server.url}/v1/messages", data=b'{"messages": [', method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        body = json.loads(err.value.read())
        assert err.value.code == 400 and body["type"] == "error" and "not valid JSON" in body["error"]["message"]
        assert len(server.call_log) == 0


@pytest.mark.integration
def test_claude_code_subagent_request_sequence_gets_roles_and_splices(tokenizer, engines):  # noqa: F811
    """The Agent-tool path, sent directly in the shape Claude Code 2.1.197 was recorded sending (a tiny
    model will not choose the Agent tool): the parent's call, the sub-agent's calls with the
    x-claude-code-agent-id header and its compaction, then the parent resuming with the result."""
    agent_id = "a69c7a3addf671402"
    system = [{"type": "text", "text": "You are a Claude agent, built on Anthropic's Claude Agent SDK.",
               "cache_control": {"type": "ephemeral"}}]  # fmt: skip
    main_system = [*system, {"type": "text", "text": "\nYou are an interactive agent that helps users."}]
    sub_system = [*system, {"type": "text", "text": "You are an agent for Claude Code, Anthropic's official CLI."}]
    extra = {"thinking": {"type": "adaptive"}, "metadata": {"user_id": "{}"}, "output_config": {"effort": "high"}}
    tools = [*A_TOOLS, {"name": "Agent", "description": "Launch a new agent", "input_schema": {"type": "object"}}]
    with running_proxy(tokenizer, [engines[0].url], max_output_tokens=6) as server:
        main = client_for(f"{server.url}/rollout/cc", default_headers=CC_HEADERS)
        sub = client_for(f"{server.url}/rollout/cc", default_headers={**CC_HEADERS, "x-claude-code-agent-id": agent_id})
        user = [{"role": "user", "content": "Delegate: write 9 into out_3.txt"}]
        first = main.messages.create(
            model="m", system=main_system, messages=user, tools=tools, max_tokens=64000, extra_body=extra
        )
        agent_call = {"type": "tool_use", "id": "toolu_fake", "name": "Agent",
                      "input": {"description": "write", "prompt": "Write 9 into out_3.txt", "subagent_type": "general-purpose"}}  # fmt: skip
        sub_user = [
            {"role": "user", "content": agent_call["input"]["prompt"]},
            {"role": "system", "content": "Skills: none"},
        ]
        s1 = sub.messages.create(model="m", system=sub_system, messages=sub_user, tools=tools, max_tokens=64000)
        sub_thread = [*sub_user, {"role": "assistant", "content": [b.model_dump() for b in s1.content]}]
        summary = [*sub_thread, {"role": "user", "content": SUMMARY_PROMPT}]
        sub.messages.create(model="m", system=sub_system, messages=summary, tools=tools, max_tokens=64000)
        parent = [*user, {"role": "assistant", "content": [*[b.model_dump() for b in first.content], agent_call]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_fake",
                                                "content": [{"type": "text", "text": "done"},
                                                            {"type": "text", "text": f"agentId: {agent_id}"}]}]}]  # fmt: skip
        main.messages.create(model="m", system=main_system, messages=parent, tools=tools, max_tokens=64000)
        records = server.call_log.for_rollout("cc")
    assert [r.role for r in records] == ["main", "subagent", "subagent_summary", "main"]
    assert [s.source_call_id for s in records[2].spliced] == [records[1].call_id]
    # The parent's re-sent turn carries a tool call the proxy never produced: tokenized from text.
    assert (
        records[3].retokenized_turns == 1 and records[3].input_ids[: len(records[0].input_ids)] == records[0].input_ids
    )
