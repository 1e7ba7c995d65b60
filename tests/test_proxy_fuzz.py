"""Fuzzing the three APIs of the proxy: requests as the official SDKs send them (captured off the `openai` and
`anthropic` clients), mutated in structure, bytes and HTTP framing, sent to a proxy in front of a real
engine. Not one answer may be a 5xx or break the API's shape, no error may reach the logs as a crash,
and only valid requests may reach the engine."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gzip
import json
import logging
import random
import time
import typing
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
from openai.types.chat import completion_create_params
from openai.types.responses import response_create_params
from test_proxy_hardening import engine, model_dir, running_proxy  # noqa: F401

from gyre.proxy.openai_api import KNOWN_FIELDS
from gyre.proxy.responses_schema import ResponsesBody

pytestmark = pytest.mark.integration
N_MUTATED = 2000
SURROGATE = "\\ud800"  # a lone UTF-16 surrogate, as JSON text


# ---------------------------------------------------------------- requests as the SDKs send them


def _captured(send: typing.Callable[[Any], object], http_lib: Any = httpx) -> list[tuple[str, dict[str, str], bytes]]:
    """(path, headers, body) of every request `send` makes through an SDK client."""
    seen: list[tuple[str, dict[str, str], bytes]] = []

    def handler(request: Any) -> Any:
        keep = {k: v for k, v in request.headers.items() if k in ("content-type", "anthropic-version")}
        seen.append((request.url.path, keep, request.content))
        return http_lib.Response(500, json={})  # a failure: the SDK raises, we only wanted the request

    with http_lib.Client(transport=http_lib.MockTransport(handler)) as http:
        try:
            send(http)
        except (openai.APIError, anthropic.APIError):
            pass
    return seen


def sdk_requests() -> list[tuple[str, dict[str, str], bytes]]:
    tool = {"type": "function", "function": {"name": "write_file", "description": "Write a file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["path", "content"]}}}  # fmt: skip
    history = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Write 4 to a.txt"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1_0", "type": "function", "function": {"name": "write_file", "arguments": '{"path": "a.txt", "content": "4"}'}}]},
        {"role": "tool", "tool_call_id": "call_1_0", "content": "ok"},
    ]  # fmt: skip
    new_params = dict(prompt_cache_key="k", safety_identifier="s", verbosity="low", prompt_cache_retention="24h")

    def openai_calls(http: httpx.Client) -> None:
        client = openai.OpenAI(base_url="http://proxy/v1", api_key="x", http_client=http, max_retries=0)
        for kwargs in (
            dict(messages=[{"role": "user", "content": "hi"}], max_tokens=2),
            dict(messages=history, tools=[tool], tool_choice="auto", stream=True, stream_options={"include_usage": True}),
            dict(messages=history, tools=[tool], tool_choice="none", max_tokens=2),
            dict(messages=history, tools=[tool], temperature=0.7, top_p=0.9, seed=3, stop=["\n\n"], logprobs=True,
                 top_logprobs=0, max_completion_tokens=2, user="u", metadata={"a": "b"}, store=False,
                 parallel_tool_calls=True, reasoning_effort="low", service_tier="auto", n=1,
                 response_format={"type": "text"}, presence_penalty=0, frequency_penalty=0, **new_params),
        ):  # fmt: skip
            with contextlib.suppress(openai.APIError):
                client.chat.completions.create(model="gpt-5", **kwargs)

    a_history = [
        {"role": "user", "content": "Write 4 to a.txt"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "plan", "signature": "s"},
                                          {"type": "text", "text": "Sure."},
                                          {"type": "tool_use", "id": "toolu_1_0", "name": "Write", "input": {"path": "a.txt"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1_0",
                                      "content": [{"type": "text", "text": "ok"}]}, {"type": "text", "text": "go on"}]},
    ]  # fmt: skip
    a_tool = {"name": "Write", "description": "Write a file.", "input_schema": {"type": "object", "properties": {}}}

    def anthropic_calls(http: Any) -> None:
        client = anthropic.Anthropic(base_url="http://proxy", api_key="x", http_client=http, max_retries=0)
        for kwargs in (
            dict(messages=[{"role": "user", "content": "hi"}], max_tokens=2),
            dict(messages=a_history, max_tokens=2, system=[{"type": "text", "text": "Be brief.",
                 "cache_control": {"type": "ephemeral"}}], tools=[a_tool], stop_sequences=["END"],
                 metadata={"user_id": "u"}, thinking={"type": "adaptive"}, stream=True,
                 extra_body={"temperature": 1.0, "top_p": 0.9, "top_k": 5}),
        ):  # fmt: skip
            with contextlib.suppress(anthropic.APIError):
                client.messages.create(model="claude-opus-4-8", **kwargs)
        with contextlib.suppress(anthropic.APIError):
            client.messages.count_tokens(model="claude-opus-4-8", messages=a_history, tools=[a_tool])

    r_tool = {"type": "function", **tool["function"]}
    r_history = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"role": "user", "content": "Write 4 to a.txt"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "plan"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
        {"type": "function_call", "call_id": "call_1_0", "name": "write_file", "arguments": '{"path": "a.txt"}'},
        {"type": "function_call_output", "call_id": "call_1_0", "output": "ok"},
    ]  # fmt: skip

    def responses_calls(http: httpx.Client) -> None:
        client = openai.OpenAI(base_url="http://proxy/v1", api_key="x", http_client=http, max_retries=0)
        for kwargs in (
            dict(input="hi", max_output_tokens=2),
            dict(input=r_history, tools=[r_tool], tool_choice="none", max_output_tokens=2, truncation="disabled"),
            dict(input=r_history, instructions="You are Codex.", tools=[r_tool], tool_choice="auto",
                 parallel_tool_calls=False, stream=True, store=False, include=["reasoning.encrypted_content"],
                 reasoning={"effort": "low", "summary": "auto"}, prompt_cache_key="k", max_output_tokens=2,
                 temperature=0.7, top_p=0.9, text={"verbosity": "low"}),
        ):  # fmt: skip
            with contextlib.suppress(openai.APIError):
                client.responses.create(model="gpt-5-codex", **kwargs)

    return (
        _captured(openai_calls) + _captured(responses_calls) + _captured(anthropic_calls, httpx2)
    )  # the anthropic SDK speaks httpx2


# ---------------------------------------------------------------- mutations


def _paths(node: Any, at: tuple = ()) -> list[tuple]:
    out = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*at, i))
    return out


def _set(root: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    node = root
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return root


def _delete(root: Any, path: tuple) -> Any:
    if not path:
        return root
    node = root
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return root


def _odd_value(rng: random.Random) -> Any:
    return rng.choice([
        None, True, False, 0, -1, 1, 2**70, -(2**70), 1e308, -1e-308, 0.5, "", "x", "0", "true", "1e3", [], {}, [[]],
        {"type": None}, [{"type": "text"}], {"role": "user"}, "ü" * 3, "\u0000", "x" * 5000, [1, "a", None],
        {"type": "image_url", "image_url": {"url": "http://x"}}, {"type": "function", "function": 3},
    ])  # fmt: skip


SAMPLING = {
    "temperature": [-0.1, 2.5, 1e9, "1", True],
    "top_p": [0, 0.0, -0.5, 1.5, "0.9"],
    "top_k": [-1, 0.5, "5"],
    "max_tokens": [0, -5, 1.5, "2", True, 2**64],
    "max_completion_tokens": [0, -1],
    "n": [0, 2, 5, 1.0],
    "seed": [2**64, 1.5, "7"],
    "top_logprobs": [-1, 21, 3],
    "tool_choice": ["required", "none", {"type": "function", "function": {"name": "write_file"}}, {"type": "any"}],
    "response_format": [{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}],
    "presence_penalty": [3, -3],
    "frequency_penalty": [2.5],
    "logit_bias": [{"1": 101}, {"1": "x"}, []],
    "stop": [["a"] * 5, [""], 7, [None]],
    "stop_sequences": ["END", [""], [3]],
    "stream": ["yes", 1],
}
BAD_TOOLS = [
    "write_file", {}, [None], [3], [{"type": "function"}], [{"type": "function", "function": []}],
    [{"type": "function", "function": {"name": 3}}], [{"type": "function", "function": {"name": ""}}],
    [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}],
    [{"type": "function", "function": {"name": "f", "parameters": [1, 2]}}],
    [{"type": "custom", "custom": {"name": "f"}}], [{"name": None, "input_schema": 5}], [{"input_schema": {}}],
]  # fmt: skip


def mutate(
    rng: random.Random, path: str, headers: dict[str, str], body: bytes
) -> tuple[str, str, dict[str, str], bytes]:
    """(method, path, headers, body) of one bad (or, by chance, still valid) request."""
    headers = dict(headers)
    doc = json.loads(body)
    kind = rng.randrange(12)
    if kind == 0:  # any node replaced
        p = rng.choice(_paths(doc))
        doc = _set(doc, p, _odd_value(rng))
    elif kind == 1:  # any node dropped
        p = rng.choice(_paths(doc)[1:])
        doc = _delete(doc, p)
    elif kind == 2:  # a key the API does not have, anywhere
        objects = [p for p in _paths(doc) if isinstance(_get(doc, p), dict)]
        _get(doc, rng.choice(objects))[rng.choice(["frobnicate", "role", "type", "content", "__proto__"])] = _odd_value(
            rng
        )
    elif kind == 3:  # sampling parameters out of range
        name = rng.choice(list(SAMPLING))
        doc[name] = rng.choice(SAMPLING[name])
    elif kind == 4:
        doc["tools"] = copy.deepcopy(rng.choice(BAD_TOOLS))
    elif kind == 5:  # deep nesting somewhere
        depth = rng.choice([50, 199, 250, 5000])
        p = rng.choice(_paths(doc))
        doc = _set(doc, p, json.loads("[" * depth + "]" * depth) if depth < 900 else None)
        if depth >= 900:
            raw = json.dumps(doc).replace("null", "[" * depth + "]" * depth, 1)
            return "POST", path, headers, raw.encode()
    elif kind == 6:  # a lone surrogate in some string (a streamed request has one too, in its text)
        strings = [p for p in _paths(doc) if isinstance(_get(doc, p), str)]
        if strings:
            doc = _set(doc, rng.choice(strings), "@@S@@")
        return "POST", path, headers, json.dumps(doc).replace("@@S@@", f"a{SURROGATE}b").encode()
    raw = json.dumps(doc).encode()
    if kind == 7:  # bytes: cut, flipped, invalid UTF-8, trailing data
        cut = rng.randrange(len(raw))
        raw = rng.choice(
            [raw[:cut], raw[:cut] + b"\xff\xfe" + raw[cut:], raw + b"}", raw + b" {}", raw[:cut] + b"\x00"]
        )
    elif kind == 8:  # bodies that are no request
        raw = rng.choice([b"", b"null", b"[]", b"1", b'"str"', b"1e999999", b"[" * 100_000, b"{" * 10, b"NaN"])
    elif kind == 9:  # a content encoding that lies
        headers["content-encoding"] = rng.choice(["gzip", "deflate", "br", "zstd", "gzip, gzip", "x-unknown"])
        if rng.random() < 0.2:
            raw = gzip.compress(raw)[: rng.randrange(1, 30)]
    elif kind == 10:  # the wrong method, or a path the API does not have
        method = rng.choice(["GET", "PUT", "DELETE", "PATCH"])
        sub = rng.choice(["", "/batches", "/x", "/../models"])
        return method, path + sub, headers, raw
    elif kind == 11:
        other = rng.choice(
            ["/v1/complete", "/v1/messages/batches", "/v1/embeddings", "/v1/chat", "/v1/responses", "/v2/x"]
        )
        return "POST", other, headers, raw
    return "POST", path, headers, raw


def _get(root: Any, path: tuple) -> Any:
    for key in path:
        root = root[key]
    return root


def fixed_cases(bases: list[tuple[str, dict[str, str], bytes]]) -> list[tuple[str, str, dict[str, str], bytes]]:
    """What the issue names, every time: top_p=0, a lone surrogate in a streamed request, gzip that is not."""
    out = []
    for path, headers, body in bases:
        doc = json.loads(body)
        out.append(("POST", path, headers, json.dumps({**doc, "top_p": 0}).encode()))
        out.append(
            (
                "POST",
                path,
                headers,
                json.dumps({**doc, "stream": True, "model": "@@"}).replace("@@", SURROGATE).encode(),
            )
        )
        out.append(("POST", path, {**headers, "content-encoding": "gzip"}, body))
        out.append(
            (
                "POST",
                path,
                headers,
                json.dumps({**doc, "tools": [{"type": "function", "function": {"name": 1}}]}).encode(),
            )
        )
        out.append(("POST", path, headers, b'{"messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"))
        out.append(("GET", path, headers, b""))
    return out


# ---------------------------------------------------------------- checks


def _anthropic_path(path: str, headers: dict[str, str]) -> bool:
    return "anthropic-version" in headers or path.split("/v1/", 1)[-1].startswith(("messages", "complete"))


def check_answer(path: str, headers: dict[str, str], status: int, ctype: str, text: str) -> str | None:
    """None if the answer is in the API's shape, else what is wrong."""
    if status >= 500:
        return f"status {status}"
    if status == 200 and ctype == "text/event-stream":
        for line in text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                json.loads(line[6:])
        return None
    body = json.loads(text)
    if status == 200:
        kinds = ("chat.completion", "list", "response")  # a completion, or the model list (GET /v1/messages/../models)
        ok = body.get("object") in kinds or body.get("type") == "message" or "input_tokens" in body
        return None if ok else f"200 with {text[:200]}"
    if _anthropic_path(path, headers):
        shape = body.get("type") == "error" and isinstance(body["error"].get("type"), str)
        ok = shape and isinstance(body["error"].get("message"), str)
    else:  # (or, for aiohttp's own errors before the request is known, both shapes in one: errors.both_shapes_body)
        both = set(body) == {"type", "error"} and body["type"] == "error"
        ok = (set(body) == {"error"} or both) and set(body["error"]) >= {"message", "type", "param", "code"}
    return None if ok else f"{status} not in the API's shape: {text[:300]}"


async def send_all(url: str, cases: list[tuple[str, str, dict[str, str], bytes]]) -> list[tuple[int, str, str]]:
    import aiohttp

    limit = asyncio.Semaphore(16)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:

        async def one(method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, str, str]:
            async with limit, session.request(method, url + path, data=body, headers=headers) as resp:
                return resp.status, resp.content_type, (await resp.read()).decode("utf-8")  # strict UTF-8

        return await asyncio.gather(*(one(*c) for c in cases))


def test_the_sdk_parameters_of_today_are_known():
    sdk = set(typing.get_type_hints(completion_create_params.CompletionCreateParamsStreaming))
    assert sdk - KNOWN_FIELDS == set(), "fields the installed openai SDK sends that the proxy would refuse"


def test_the_responses_parameters_of_today_are_known():
    sdk = set(typing.get_type_hints(response_create_params.ResponseCreateParamsStreaming))
    assert sdk - set(ResponsesBody.model_fields) == set(), "Responses fields the openai SDK sends that are unknown"


def test_fuzzed_requests_get_no_5xx_and_errors_in_each_apis_shape(model_dir, engine, caplog):  # noqa: F811
    caplog.set_level(logging.WARNING, logger="gyre")
    bases = sdk_requests()
    paths = {"/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"}
    assert {p for p, _, _ in bases} == paths
    rng = random.Random(15)
    cases = fixed_cases(bases) + [mutate(rng, *rng.choice(bases)) for _ in range(N_MUTATED)]
    with running_proxy(model_dir, [engine.url], max_output_tokens=2, max_body_mb=1) as server:
        t0 = time.monotonic()
        answers = asyncio.run(send_all(server.url, cases))
        elapsed = time.monotonic() - t0
        problems = [
            (m, p, body[:120], why)
            for (m, p, h, body), (status, ctype, text) in zip(cases, answers, strict=True)
            if (why := check_answer(p, h, status, ctype, text))
        ]
        assert problems == [], problems[:10]
        model_calls = sum(
            1 for (m, p, _, _), (status, _, _) in zip(cases, answers, strict=True)
            if status == 200 and m == "POST" and p in ("/v1/chat/completions", "/v1/responses", "/v1/messages")
        )  # fmt: skip
        assert len(server.call_log) == model_calls  # only valid requests reached the engine
        fixed = answers[: len(fixed_cases(bases))]
        assert all(status in (400, 404, 405) for status, _, _ in fixed), [s for s, _, _ in fixed]
    crashes = [r.getMessage() for r in caplog.records if r.name.startswith("gyre") and r.levelno >= logging.ERROR]
    assert crashes == []
    statuses = sorted({s for s, _, _ in answers})
    assert 200 in statuses and 400 in statuses and 404 in statuses and 405 in statuses, statuses
    assert elapsed < 90, f"{len(cases)} requests took {elapsed:.0f} s"
