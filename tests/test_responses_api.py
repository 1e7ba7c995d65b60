"""The OpenAI Responses API of the proxy (`POST /v1/responses`, what Codex CLI speaks): request conversion,
refusals in OpenAI's error shape, and end to end with the official `openai` client (plain, streamed, the
`responses.stream()` helper, a function call round trip spliced token for token) against real embedded
engines (fixtures from test_proxy)."""

from __future__ import annotations

import json

import openai
import pytest
from test_proxy import MEMO_ARGS, MEMO_MESSAGES, TOOLS, engines, model_dir, running_proxy, tokenizer  # noqa: F401

from gyre.proxy.errors import ProxyError
from gyre.proxy.responses_api import convert_input, output_items, parse_responses_request, sse_events
from gyre.proxy.roles import CODEX_SUMMARY_MARKER, chat_call_role

R_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
INSTRUCTIONS = MEMO_MESSAGES[0]["content"]
R_INPUT = [{"role": "user", "content": [{"type": "input_text", "text": MEMO_MESSAGES[1]["content"]}]}]
GREEDY = {"temperature": 0}


# ---------------------------------------------------------------- conversion (unit)


@pytest.mark.unit
def test_codex_shaped_input_folds_model_turns_and_keeps_roles():
    body = {
        "model": "gpt-5-codex",
        "instructions": "You are Codex.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions/>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix it"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "hm"}],
             "content": [{"type": "reasoning_text", "text": "hm"}], "encrypted_content": None},
            {"type": "message", "role": "assistant", "id": "msg_1",
             "content": [{"type": "output_text", "text": "Look.", "annotations": []}]},
            {"type": "function_call", "call_id": "call_1_0", "name": "shell", "arguments": '{"command":["ls"]}'},
            {"type": "function_call", "call_id": "call_1_1", "name": "shell", "arguments": ""},
            {"type": "function_call_output", "call_id": "call_1_0", "output": "a.txt"},
            {"type": "function_call_output", "call_id": "call_1_1", "output": "b.txt"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
        ],
        "tools": [{"type": "function", "name": "shell", "description": "Run.", "strict": False,
                   "parameters": {"type": "object", "properties": {"command": {"type": "array"}}}}],
        "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False, "stream": True, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "abc",
        "text": {"verbosity": "low"},
    }  # fmt: skip
    req = parse_responses_request(body, "gyre-policy")
    assert req.model == "gpt-5-codex" and req.stream and req.tool_names == ["shell"]
    assert req.messages == [
        {"role": "system", "content": "You are Codex."},
        {"role": "system", "content": "<permissions/>"},
        {"role": "user", "content": "Fix it"},
        {"role": "assistant", "content": "<think>hm</think>Look.", "tool_calls": [
            {"id": "call_1_0", "type": "function", "function": {"name": "shell", "arguments": '{"command":["ls"]}'}},
            {"id": "call_1_1", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1_0", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "call_1_1", "content": "b.txt"},
        {"role": "assistant", "content": "Done."},
    ]  # fmt: skip


@pytest.mark.unit
def test_output_items_round_trip_into_the_same_assistant_message():
    calls = [{"name": "write_file", "arguments": MEMO_ARGS}]
    items = output_items(7, "<think>plan</think>I will write it.", calls, ["call_7_0"])
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    sent_back = [{k: v for k, v in i.items() if k not in ("id", "status")} for i in items]
    (turn,) = convert_input(None, sent_back)
    assert turn["content"] == "<think>plan</think>I will write it." and turn["tool_calls"][0]["id"] == "call_7_0"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "no conversation state"),
        ({"conversation": "conv_1"}, "conversation", "no conversation state"),
        ({"tools": [{"type": "web_search"}]}, "tools", "only tools of type function"),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice"),
        ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice", "tool_choice"),
        ({"top_logprobs": 3}, "top_logprobs", "top logprobs"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text", "format"),
        ({"input": [{"type": "image_generation_call"}]}, "input", "image_generation_call"),
        ({"temperature": "1"}, "temperature", "temperature"),
        ({"frobnicate": 1}, "frobnicate", "Unrecognized"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(extra, param, words):
    with pytest.raises(ProxyError) as e:
        parse_responses_request({"input": "hi", **extra}, "m")
    assert e.value.status == 400 and e.value.param == param and words in e.value.message


@pytest.mark.unit
def test_codex_turn_metadata_labels_compaction_and_subagent_calls():
    """Codex 0.171.0's headers: request_kind "turn" / "compaction" (observed), agent_name "/root" for the main agent."""

    def role(kind: str, agent: str, user: str = "Write 4 to a.txt", tools: bool = True) -> str:
        meta = json.dumps({"request_kind": kind, "agent_name": agent, "window_number": 0})
        messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": user}]
        return chat_call_role({"X-Codex-Turn-Metadata": meta}, messages, tools)

    assert role("turn", "/root") == "main"
    assert (
        role("compaction", "/root", f"{CODEX_SUMMARY_MARKER}. Create a handoff summary", tools=False) == "main_summary"
    )
    assert role("turn", "/root/worker") == "subagent" and role("compaction", "/root/worker") == "subagent_summary"
    assert chat_call_role({"x-codex-turn-metadata": "not json"}, [{"role": "user", "content": "hi"}], True) == "main"


@pytest.mark.unit
def test_stream_events_are_numbered_and_close_every_item():
    items = output_items(3, "<think>a</think>b", [{"name": "f", "arguments": {"x": 1}}], ["call_3_0"])
    done = {"status": "completed", "output": items}
    events = sse_events({"status": "in_progress", "output": []}, done)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    assert "response.function_call_arguments.delta" in kinds and "response.output_text.delta" in kinds


# ---------------------------------------------------------------- end to end with the openai client


@pytest.fixture(scope="module")
def proxy(tokenizer, engines):  # noqa: F811
    with running_proxy(tokenizer, [engines[0].url]) as server:
        yield server


def client_for(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.integration
def test_function_call_reply_matches_the_record(proxy):
    client = client_for(f"{proxy.url}/rollout/plain")
    resp = client.responses.create(
        model="gpt-5-codex", instructions=INSTRUCTIONS, input=R_INPUT, tools=R_TOOLS, max_output_tokens=64,
        temperature=0, store=False,
    )  # fmt: skip
    (record,) = proxy.call_log.for_rollout("plain")
    assert resp.status == "completed" and resp.model == "gpt-5-codex"
    assert [i.type for i in resp.output] == ["message", "function_call"] and resp.output_text == "I will write it."
    call = resp.output[1]
    assert call.name == "write_file" and call.call_id == f"call_{record.call_id}_0"
    assert json.loads(call.arguments) == MEMO_ARGS
    assert resp.usage.input_tokens == record.prompt_tokens == len(record.input_ids)
    assert resp.usage.output_tokens == len(record.output_ids)
    assert resp.usage.total_tokens == len(record.input_ids) + len(record.output_ids)
    assert record.api == "responses" and record.role == "main" and record.tool_names == ["write_file"]


@pytest.mark.integration
def test_streamed_call_then_function_call_output_is_spliced_verbatim(proxy):
    client = client_for(f"{proxy.url}/rollout/stream")
    stream = client.responses.create(
        model="m", instructions=INSTRUCTIONS, input=R_INPUT, tools=R_TOOLS, max_output_tokens=64, temperature=0,
        stream=True,
    )  # fmt: skip
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.delta" in kinds
    first = events[-1].response
    (rec1,) = proxy.call_log.for_rollout("stream")
    assert first.usage.input_tokens == rec1.prompt_tokens and first.usage.output_tokens == len(rec1.output_ids)
    call = first.output[1]
    # what Codex sends back with store=false: the output items without ids, arguments re-serialized
    history = [
        *R_INPUT,
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": '{"content": "9", "path": "out_3.txt"}'},
        {"type": "function_call_output", "call_id": call.call_id, "output": "wrote 1 byte"},
    ]  # fmt: skip
    with client.responses.stream(
        model="m", instructions=INSTRUCTIONS, input=history, tools=R_TOOLS, max_output_tokens=4, temperature=0
    ) as helper:
        second = helper.get_final_response()
    rec2 = proxy.call_log.for_rollout("stream")[1]
    (span,) = rec2.spliced
    assert span.source_call_id == rec1.call_id
    assert rec2.input_ids[span.start : span.start + span.length] == rec1.output_ids
    assert rec2.input_ids[: len(rec1.input_ids)] == rec1.input_ids and rec2.retokenized_turns == 0
    assert second.usage.input_tokens == rec2.prompt_tokens and second.status in ("completed", "incomplete")


@pytest.mark.integration
def test_errors_come_back_in_openai_shape(proxy):
    client = client_for(f"{proxy.url}/rollout/errors")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="hi", previous_response_id="resp_123")
    assert e.value.status_code == 400 and e.value.body["param"] == "previous_response_id"
    assert "no conversation state" in e.value.body["message"]
    proxy.force_context_limit("errors", 3)
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="m", instructions=INSTRUCTIONS, input=R_INPUT)
        assert e.value.body["code"] == "context_length_exceeded"
    finally:
        proxy.force_context_limit("errors", None)
    assert proxy.call_log.for_rollout("errors") == []
