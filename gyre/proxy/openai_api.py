"""OpenAI Chat Completions: request validation and response shapes (plain and streamed).

Pure functions, no I/O: the server turns a JSON body into a `ChatRequest`, and a `Reply` into the
response body or the list of `chat.completion.chunk` objects.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gyre.proxy.errors import invalid_request

KNOWN_FIELDS = frozenset(
    {
        "model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens",
        "max_completion_tokens", "stream", "stream_options", "n", "stop", "seed", "user",
        "parallel_tool_calls", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
        "logit_bias", "response_format", "metadata", "store", "reasoning_effort", "service_tier",
        "modalities", "prediction", "audio", "web_search_options",
        # Deprecated but still sent by older clients.
        "functions", "function_call",
    }
)  # fmt: skip
ROLES = ("system", "developer", "user", "assistant", "tool")


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


def _number(body: dict[str, Any], name: str, lo: float, hi: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise invalid_request(f"'{name}' must be a number between {lo} and {hi}, got {value!r}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, lo: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise invalid_request(f"'{name}' must be an integer >= {lo}, got {value!r}", name)
    return value


def _check_content(content: Any, where: str, nullable: bool) -> None:
    if content is None:
        if not nullable:
            raise invalid_request(f"{where}.content is required", "messages")
        return
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise invalid_request(f"{where}.content must be a string or a list of text parts", "messages")
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("text", "refusal"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid_request(f"{where}.content[{j}] is {kind!r}; only text parts are supported", "messages")
        if not isinstance(part.get("text", part.get("refusal")), str):
            raise invalid_request(f"{where}.content[{j}].text must be a string", "messages")


def _check_tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise invalid_request(f"{where}.tool_calls must be a list", "messages")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid_request(f"{where}.tool_calls[{j}] needs function.name", "messages")
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            raise invalid_request(f"{where}.tool_calls[{j}].function.arguments must be a JSON string", "messages")
        try:
            parsed = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise invalid_request(f"{where}.tool_calls[{j}].function.arguments is not JSON: {e}", "messages") from e
        if not isinstance(parsed, dict):
            raise invalid_request(f"{where}.tool_calls[{j}].function.arguments must be a JSON object", "messages")


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """Validated messages; `developer` becomes `system` (the template has no developer role)."""
    if not isinstance(messages, list) or not messages:
        raise invalid_request("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid_request(f"{where} must be an object", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise invalid_request(f"{where}.role is {role!r}; use one of {', '.join(ROLES)}", "messages")
        has_calls = bool(m.get("tool_calls"))
        _check_content(m.get("content"), where, nullable=role == "assistant")
        if role == "assistant" and m.get("tool_calls") is not None:
            _check_tool_calls(m["tool_calls"], where)
        elif has_calls:
            raise invalid_request(f"{where}: only assistant messages may have tool_calls", "messages")
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise invalid_request(f"{where}: a tool message needs 'tool_call_id'", "messages")
        out.append({**m, "role": "system" if role == "developer" else role})
    return out


def parse_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid_request("'tools' must be a list", "tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
    return tools or None


def parse_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise invalid_request("'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    return stops


def parse_chat_request(body: Any, default_model: str) -> ChatRequest:
    if not isinstance(body, dict):
        raise invalid_request("the request body must be a JSON object")
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise invalid_request(f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0])
    n = _integer(body, "n", 1)
    if n not in (None, 1):
        raise invalid_request(f"only n=1 is supported, got n={n}", "n")
    for flag in ("stream", "logprobs"):
        if body.get(flag) is not None and not isinstance(body[flag], bool):
            raise invalid_request(f"'{flag}' must be a boolean", flag)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise invalid_request("'stream_options' must be an object", "stream_options")
    model = body.get("model") or default_model
    if not isinstance(model, str):
        raise invalid_request("'model' must be a string", "model")
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise invalid_request("'seed' must be an integer", "seed")
    return ChatRequest(
        model=model,
        messages=parse_messages(body.get("messages")),
        tools=parse_tools(body.get("tools")),
        temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_number(body, "top_p", 0.0, 1.0, 1.0),
        max_tokens=max_tokens,
        stop=parse_stop(body.get("stop")),
        seed=seed,
        stream=bool(body.get("stream")),
        include_usage=bool(stream_options.get("include_usage")),
        logprobs=bool(body.get("logprobs")),
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
