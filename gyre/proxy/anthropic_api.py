"""Anthropic Messages API: request -> the proxy's chat messages, and reply -> response body or SSE events.

Pure functions, no I/O. Requests become the OpenAI-style messages the chat template and the TITO
renderer already speak: `system` (a string or text blocks) leads, `role: "system"` messages stay in
place, `tool_result` blocks become `tool` messages, `tool_use` blocks become `tool_calls`, and
thinking blocks become `<think>...</think>` text, exactly as the model generated them, so a reply
re-sent by the harness is found again in the call log (by tool_use id, else by its text).
Fields the proxy has no use for (thinking, context_management, output_config, metadata,
cache_control, ...) are accepted and ignored; any model name maps to the policy.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter

from gyre.model.chat_template import THINK_END, THINK_START
from gyre.proxy.anthropic_schema import Message, MessagesBody, Tool
from gyre.proxy.calls import GenParams
from gyre.proxy.errors import validation_error
from gyre.proxy.schema_util import validate_in_slices

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_OUR_TOOL_ID = re.compile(r"toolu_\d+_\d+")
LISTS = {"messages": TypeAdapter(list[Message]), "tools": TypeAdapter(list[Tool])}


@dataclass
class MessagesRequest:
    model: str
    messages: list[dict[str, Any]]  # OpenAI-style, ready for CallRunner
    tools: list[dict[str, Any]] | None
    params: GenParams
    stream: bool = False
    system_text: str = ""
    user_text: str = ""  # everything the user messages say (tool results aside), for role labels
    tool_names: list[str] = field(default_factory=list)


def tool_use_id(openai_id: str) -> str:
    """The id handed out in a tool_use block for the proxy's tool call id `call_<call>_<n>`."""
    return "toolu_" + openai_id.removeprefix("call_")


def openai_tool_id(anthropic_id: str) -> str:
    """Inverse of `tool_use_id`; ids the proxy never handed out pass through unchanged."""
    return "call_" + anthropic_id[6:] if _OUR_TOOL_ID.fullmatch(anthropic_id) else anthropic_id


def _blocks(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def blocks_text(content: str | list[dict[str, Any]]) -> str:
    """Text of a string or of text blocks; other blocks (images, documents) leave a visible marker."""
    return "".join(b["text"] if b["type"] == "text" else f"[{b['type']}]" for b in _blocks(content))


def _typed_text(content: str | list[dict[str, Any]]) -> str:
    """What the user typed in one message: its text blocks, without tool results."""
    return "".join(b["text"] for b in _blocks(content) if b["type"] == "text")


def _user_messages(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One user message becomes `tool` messages for its tool results and user messages for its text."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []

    def flush() -> None:
        if pending:
            out.append({"role": "user", "content": "".join(pending)})
            pending.clear()

    for block in _blocks(content):
        if block["type"] == "tool_result":
            flush()
            result = block.get("content")
            text = blocks_text(result) if result else ""
            out.append({"role": "tool", "tool_call_id": openai_tool_id(block["tool_use_id"]), "content": text})
        elif block["type"] == "text":
            pending.append(block["text"])
        else:
            pending.append(f"[{block['type']}]")
    flush()
    return out or [{"role": "user", "content": ""}]


def _assistant_message(content: str | list[dict[str, Any]]) -> dict[str, Any]:
    text, calls = [], []
    for block in _blocks(content):
        kind = block["type"]
        if kind == "text":
            text.append(block["text"])
        elif kind == "thinking":
            text.append(f"{THINK_START}{block.get('thinking', '')}{THINK_END}")
        elif kind == "tool_use":
            call_id = openai_tool_id(block.get("id", ""))
            arguments = block.get("input", {})
            calls.append(
                {"id": call_id, "type": "function", "function": {"name": block["name"], "arguments": arguments}}
            )
        # redacted_thinking and server tool blocks carry nothing the policy generated here
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        message["tool_calls"] = calls
    return message


def convert_messages(system: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as validated by `MessagesBody` -> the proxy's OpenAI-style messages."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": blocks_text(system)})
    for m in messages:
        if m["role"] == "user":
            out.extend(_user_messages(m["content"]))
        elif m["role"] == "assistant":
            out.append(_assistant_message(m["content"]))
        else:
            out.append({"role": "system", "content": blocks_text(m["content"])})
    return out


def convert_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    out = []
    for tool in tools or []:
        spec = {
            "name": tool["name"],
            "description": tool.get("description") or "",
            "parameters": tool.get("input_schema") or {},
        }
        out.append({"type": "function", "function": spec})
    return out or None


def parse_messages_request(body: Any, default_model: str) -> MessagesRequest:
    """A validated, converted request (gyre.proxy.anthropic_schema); raises a 400 ProxyError otherwise."""
    req, errors = validate_in_slices(MessagesBody, body, LISTS)
    if errors or req is None:
        raise validation_error(errors)
    params = GenParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        max_tokens=req.max_tokens,
        stop=list(req.stop_sequences or []),
        tool_calls=req.tool_choice is None or req.tool_choice.type != "none",
        parallel_tool_calls=not (req.tool_choice and req.tool_choice.disable_parallel_tool_use),
    )
    tools = convert_tools(body.get("tools"))
    users = [m for m in body["messages"] if m["role"] == "user"]
    return MessagesRequest(
        model=req.model or default_model,
        messages=convert_messages(body.get("system"), body["messages"]),
        tools=tools,
        params=params,
        stream=bool(req.stream),
        system_text=blocks_text(body["system"]) if body.get("system") else "",
        user_text="\n".join(_typed_text(u["content"]) for u in users),
        tool_names=[t["function"]["name"] for t in tools or []],
    )


# ---------------------------------------------------------------- replies


def reply_blocks(
    content: str, tool_calls: list[dict[str, Any]], tool_call_ids: list[str], signature: str
) -> list[dict]:
    """Content blocks of a reply: a leading `<think>...</think>` becomes a thinking block."""
    blocks: list[dict[str, Any]] = []
    if content.startswith(THINK_START) and THINK_END in content:
        thinking, content = content[len(THINK_START) :].split(THINK_END, 1)
        blocks.append({"type": "thinking", "thinking": thinking, "signature": signature})
    if content:
        blocks.append({"type": "text", "text": content})
    for call_id, call in zip(tool_call_ids, tool_calls, strict=True):
        blocks.append(
            {"type": "tool_use", "id": tool_use_id(call_id), "name": call["name"], "input": call["arguments"]}
        )
    return blocks


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    """input_tokens is the whole rendered prompt: harnesses budget their context with it."""
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def message_body(
    msg_id: str, model: str, blocks: list[dict], stop_reason: str | None, stop_sequence: str | None, use: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": blocks,
        "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": use,
    }  # fmt: skip


def sse_events(
    msg_id: str, model: str, blocks: list[dict], stop_reason: str, stop_sequence: str | None, use: dict[str, int]
) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) in the order Anthropic streams them: each block opens empty, then deltas."""
    start_usage = {**use, "output_tokens": 1}
    start = message_body(msg_id, model, [], None, None, start_usage)
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start", "message": start})]
    events.append(("ping", {"type": "ping"}))
    for i, block in enumerate(blocks):
        if block["type"] == "text":
            opened, deltas = {"type": "text", "text": ""}, [{"type": "text_delta", "text": block["text"]}]
        elif block["type"] == "thinking":
            opened = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [
                {"type": "thinking_delta", "thinking": block["thinking"]},
                {"type": "signature_delta", "signature": block["signature"]},
            ]
        else:
            opened = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            args = json.dumps(block["input"], ensure_ascii=False)
            deltas = [{"type": "input_json_delta", "partial_json": args[k : k + 512]} for k in range(0, len(args), 512)]
        events.append(("content_block_start", {"type": "content_block_start", "index": i, "content_block": opened}))
        events.extend(("content_block_delta", {"type": "content_block_delta", "index": i, "delta": d}) for d in deltas)
        events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
    events.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": use}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events
