"""OpenAI Chat Completions: request validation and response shapes (plain and streamed).

Pure functions, no I/O: the server turns a JSON body into a `ChatRequest` (validated by the pydantic
models of gyre.proxy.openai_schema), and a `Reply` into the response body or the list of
`chat.completion.chunk` objects.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter

from gyre.proxy.errors import validation_error
from gyre.proxy.openai_schema import ChatCompletionBody, Message, Tool
from gyre.proxy.schema_util import validate_in_slices

KNOWN_FIELDS = frozenset(ChatCompletionBody.model_fields)
LISTS = {"messages": TypeAdapter(list[Message]), "tools": TypeAdapter(list[Tool])}


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    tool_calls: bool = True  # False: tool_choice "none"
    parallel_tool_calls: bool = True  # False: a reply holds one tool call at most

    @property
    def tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools or []]


@dataclass
class Reply:
    content: str
    tool_calls: list[dict[str, Any]]  # {"name", "arguments" (dict)}
    tool_call_ids: list[str]
    finish_reason: str  # "stop" | "length" | "tool_calls"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    token_logprobs: list[tuple[str, float]] | None = None  # (token text, logprob) when asked for


def parse_chat_request(body: Any, default_model: str) -> ChatRequest:
    """A validated request (gyre.proxy.openai_schema); raises a 400 ProxyError naming the first bad field.

    Messages are passed on as sent (the schema checked them), `developer` turned into `system`: the
    template has no developer role."""
    req, errors = validate_in_slices(ChatCompletionBody, body, LISTS)
    if errors or req is None:
        raise validation_error(errors)
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in body["messages"]]
    return ChatRequest(
        model=req.model or default_model,
        messages=messages,
        tools=body.get("tools") or None,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        max_tokens=req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        seed=req.seed,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        logprobs=bool(req.logprobs),
        tool_calls=req.tool_choice != "none",
        parallel_tool_calls=req.parallel_tool_calls is not False,
    )


def _api_tool_calls(reply: Reply) -> list[dict[str, Any]]:
    return [
        {
            "id": call_id,
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
        }
        for call_id, c in zip(reply.tool_call_ids, reply.tool_calls, strict=True)
    ]


def _usage(reply: Reply) -> dict[str, Any]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": reply.cached_tokens},
    }


def _logprobs(reply: Reply) -> dict[str, Any] | None:
    if reply.token_logprobs is None:
        return None
    return {
        "content": [
            {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
            for tok, lp in reply.token_logprobs
        ],
        "refusal": None,
    }


def completion_body(completion_id: str, created: int, model: str, reply: Reply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content, "refusal": None}
    if reply.tool_calls:
        message["tool_calls"] = _api_tool_calls(reply)
        message["content"] = reply.content or None
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "message": message, "logprobs": _logprobs(reply), "finish_reason": reply.finish_reason}
        ],
        "usage": _usage(reply),
        "system_fingerprint": None,
    }


def stream_chunks(
    completion_id: str, created: int, model: str, reply: Reply, include_usage: bool
) -> list[dict[str, Any]]:
    """The reply as `chat.completion.chunk` objects, in the order OpenAI sends them."""

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        out = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model}
        out.update(choices=[choice], system_fingerprint=None)
        if include_usage:
            out["usage"] = None
        return out

    chunks = [chunk({"role": "assistant", "content": "", "refusal": None})]
    if reply.content:
        chunks.append(chunk({"content": reply.content}, logprobs=_logprobs(reply)))
    for i, call in enumerate(_api_tool_calls(reply)):
        name_delta = {"index": i, "id": call["id"], "type": "function"}
        name_delta["function"] = {"name": call["function"]["name"], "arguments": ""}
        chunks.append(chunk({"tool_calls": [name_delta]}))
        args_delta = {"index": i, "function": {"arguments": call["function"]["arguments"]}}
        chunks.append(chunk({"tool_calls": [args_delta]}))
    chunks.append(chunk({}, reply.finish_reason))
    if include_usage:
        chunks.append(
            {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "system_fingerprint": None,
                "usage": _usage(reply),
            }
        )
    return chunks
