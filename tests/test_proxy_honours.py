"""What the proxy accepts, it honours, in every dialect (Chat Completions, Anthropic Messages, Responses):
`tool_choice: none` gives a text reply however the model answers; what would need constrained decoding or
top-k logprobs (a forced tool call, a JSON schema, `top_logprobs`) is refused by name in the API's error shape."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from test_proxy import tokenizer  # noqa: F401

from gyre.config.schema import ProxyConfig
from gyre.engine.client import GenerateResult
from gyre.model.chat_template import IM_END, TOOL_CALL_END, TOOL_CALL_START
from gyre.proxy.anthropic_api import parse_messages_request
from gyre.proxy.call_log import CallLog, read_call_log
from gyre.proxy.calls import CallRunner, GenParams
from gyre.proxy.errors import ProxyError, anthropic_status_and_body
from gyre.proxy.openai_api import parse_chat_request
from gyre.proxy.responses_api import parse_responses_request

pytestmark = pytest.mark.unit
TOOL = {"name": "write_file", "description": "Write a file.", "parameters": {"type": "object", "properties": {}}}
BASES = {
    "chat": {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": TOOL}]},
    "anthropic": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                  "tools": [{"name": "write_file", "input_schema": {"type": "object"}}]},
    "responses": {"input": "hi", "tools": [{"type": "function", **TOOL}]},
}  # fmt: skip
PARSERS = {"chat": parse_chat_request, "anthropic": parse_messages_request, "responses": parse_responses_request}
NONE = {"chat": "none", "anthropic": {"type": "none"}, "responses": "none"}


def params_of(api: str, body: dict[str, Any]) -> GenParams:
    req = PARSERS[api](body, "m")
    return (
        req.params
        if api != "chat"
        else GenParams(tool_calls=req.tool_calls, parallel_tool_calls=req.parallel_tool_calls)
    )


@pytest.mark.parametrize("api", list(BASES))
def test_tool_choice_none_turns_tool_calls_off_and_auto_keeps_them(api):
    assert params_of(api, BASES[api]).tool_calls
    assert not params_of(api, {**BASES[api], "tool_choice": NONE[api]}).tool_calls
    auto = {"type": "auto"} if api == "anthropic" else "auto"
    assert params_of(api, {**BASES[api], "tool_choice": auto}).tool_calls


REFUSED = [
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tool_choice": {"type": "function", "function": {"name": "write_file"}}}, "tool_choice"),
    ("chat", {"logprobs": True, "top_logprobs": 3}, "top_logprobs"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"presence_penalty": 0.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": -0.1}, "frequency_penalty"),
    ("chat", {"logit_bias": {"17": 5}}, "logit_bias"),
    ("anthropic", {"tool_choice": {"type": "any"}}, "tool_choice"),
    ("anthropic", {"tool_choice": {"type": "tool", "name": "write_file"}}, "tool_choice"),
    ("anthropic", {"output_format": {"type": "json_schema", "schema": {}}}, "output_format"),
    ("anthropic", {"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config"),
    ("responses", {"tool_choice": {"type": "function", "name": "write_file"}}, "tool_choice"),
    ("responses", {"include": ["message.output_text.logprobs"]}, "include"),
    ("responses", {"max_tool_calls": 1}, "max_tool_calls"),
    ("responses", {"truncation": "auto"}, "truncation"),
]  # fmt: skip


@pytest.mark.parametrize(("api", "extra", "param"), REFUSED)
def test_what_would_need_constrained_decoding_is_refused_in_the_apis_shape(api, extra, param):
    with pytest.raises(ProxyError) as e:
        PARSERS[api]({**BASES[api], **extra}, "m")
    assert e.value.status == 400 and e.value.param is not None and e.value.param.startswith(param)
    shape = anthropic_status_and_body(e.value)[1] if api == "anthropic" else e.value.body()
    assert shape["error"]["message"] and shape["error"]["type"] == "invalid_request_error"


def test_what_can_be_honoured_is_accepted():
    parse_chat_request({**BASES["chat"], "response_format": {"type": "text"}, "logprobs": True, "top_logprobs": 0,
                        "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {"17": 0}}, "m")  # fmt: skip
    parse_messages_request({**BASES["anthropic"], "output_config": {"effort": "high"}}, "m")  # Claude Code sends it
    parse_responses_request({**BASES["responses"], "include": ["reasoning.encrypted_content"],
                             "truncation": "disabled", "text": {"format": {"type": "text"}}}, "m")  # fmt: skip


class OneReply:
    """The engine's side of one call: the given text's ids as the sampled output."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    async def generate(
        self, input_ids: list[int], sampling: Any, call_id: int, rollout_id: str, routed_experts: bool = False
    ) -> tuple[str, Any]:
        result = GenerateResult("r", self.ids, [-0.1] * len(self.ids), "stop", len(input_ids), 0, "0")
        return "http://engine", result


def test_a_reply_under_tool_choice_none_is_text_even_when_the_model_writes_a_call(tokenizer, tmp_path):  # noqa: F811
    text = f'{TOOL_CALL_START}{{"name": "write_file", "arguments": {{}}}}{TOOL_CALL_END}{IM_END}'
    runner = CallRunner(tokenizer, CallLog(tmp_path / "calls.jsonl"), OneReply(tokenizer.encode(text)), ProxyConfig())
    messages, tools = [{"role": "user", "content": "hi"}], [{"type": "function", "function": TOOL}]
    try:
        auto = asyncio.run(runner.run("r", "openai", messages, tools, GenParams()))
        none = asyncio.run(runner.run("r2", "openai", messages, tools, GenParams(tool_calls=False)))
    finally:
        runner.pool.shutdown()
    assert auto.tool_calls == [{"name": "write_file", "arguments": {}}] and auto.finish_reason == "tool_calls"
    assert none.tool_calls == [] and none.finish_reason == "stop" and none.content == text.removesuffix(IM_END)
    assert none.output_ids == auto.output_ids  # what is trained is what was sampled, either way


ONE_AT_A_TIME = {
    "chat": {"parallel_tool_calls": False},
    "anthropic": {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
    "responses": {"parallel_tool_calls": False},
}


@pytest.mark.parametrize("api", list(BASES))
def test_parallel_tool_calls_false_reaches_the_call_in_every_api(api):
    assert params_of(api, BASES[api]).parallel_tool_calls
    assert not params_of(api, {**BASES[api], **ONE_AT_A_TIME[api]}).parallel_tool_calls


def test_a_reply_without_parallel_tool_calls_ends_with_its_first_call(tokenizer, tmp_path):  # noqa: F811
    one = f'{TOOL_CALL_START}{{"name": "write_file", "arguments": {{"path": "a"}}}}{TOOL_CALL_END}'
    two = f'{TOOL_CALL_START}{{"name": "write_file", "arguments": {{"path": "b"}}}}{TOOL_CALL_END}'
    ids = tokenizer.encode(one + two + IM_END)
    runner = CallRunner(tokenizer, CallLog(tmp_path / "calls.jsonl"), OneReply(ids), ProxyConfig())
    messages, tools = [{"role": "user", "content": "hi"}], [{"type": "function", "function": TOOL}]
    try:
        both = asyncio.run(runner.run("r", "openai", messages, tools, GenParams()))
        first = asyncio.run(runner.run("r2", "openai", messages, tools, GenParams(parallel_tool_calls=False)))
    finally:
        runner.pool.shutdown()
    assert [c["arguments"]["path"] for c in both.tool_calls] == ["a", "b"]
    assert first.tool_calls == [{"name": "write_file", "arguments": {"path": "a"}}]
    assert first.finish_reason == "tool_calls" and tokenizer.decode(first.output_ids) == one
    assert first.output_logprobs == [-0.1] * len(first.output_ids)  # what is trained is what the reply returned


class RoutedReply(OneReply):
    """OneReply whose engine, when asked, answers the routed experts of positions [0, prompt + output - 1)."""

    asked: bool | None = None

    async def generate(
        self, input_ids: list[int], sampling: Any, call_id: int, rollout_id: str, routed_experts: bool = False
    ) -> tuple[str, Any]:
        url, result = await super().generate(input_ids, sampling, call_id, rollout_id)
        self.asked = routed_experts
        if routed_experts:
            result.routed_experts = np.arange((len(input_ids) + len(self.ids) - 1) * 4, dtype=np.int32) % 7
        return url, result


def test_with_routing_replay_each_call_asks_and_records_its_routed_experts(tokenizer, tmp_path):  # noqa: F811
    """rl.routing_replay: the proxy asks the engine for every call's routed experts and records them with the call
    ([positions, MoE layers, top-k], cut with the output at a stop string, through calls.jsonl); an engine that
    answers none fails the call rather than record a call the trainer could not replay."""
    engine = RoutedReply(tokenizer.encode("first part. STOP and more" + IM_END))
    runner = CallRunner(tokenizer, CallLog(tmp_path / "calls.jsonl"), engine, ProxyConfig(), routed_experts=(2, 2))
    plain = CallRunner(tokenizer, CallLog(), OneReply(engine.ids), ProxyConfig(), routed_experts=(2, 2))
    messages = [{"role": "user", "content": "hi"}]
    try:
        record = asyncio.run(runner.run("r", "openai", messages, None, GenParams(stop=["STOP"])))
        with pytest.raises(ProxyError, match="returned no routed experts") as err:
            asyncio.run(plain.run("r", "openai", messages, None, GenParams()))
    finally:
        runner.pool.shutdown()
        plain.pool.shutdown()
    assert engine.asked and err.value.status == 502
    positions = len(record.input_ids) + len(record.output_ids)
    assert len(record.output_ids) < len(engine.ids)  # cut at the stop string
    want = (np.arange(positions * 4) % 7).reshape(positions, 2, 2)
    assert np.array_equal(record.routed_experts_rows(), want)
    assert np.array_equal(read_call_log(tmp_path / "calls.jsonl")[0].routed_experts_rows(), want)
