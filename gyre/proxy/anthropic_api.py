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

from gyre.model.chat_template import THINK_END, THINK_START
from gyre.proxy.calls import GenParams
from gyre.proxy.errors import invalid_request

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_OUR_TOOL_ID = re.compile(r"toolu_\d+_\d+")


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


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(
        isinstance(b, dict) and isinstance(b.get("type"), str) for b in content
    ):
        raise invalid_request(f"{where}.content must be a string or a list of content blocks with a 'type'", "messages")
    return content


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid_request(f"{where}: a text block needs a string 'text'", "messages")
    return text


def blocks_text(content: Any, where: str) -> str:
    """Text of a string or of text blocks; other blocks (images, documents) leave a visible marker."""
    parts = []
    for j, block in enumerate(_blocks(content, where)):
        parts.append(_text(block, f"{where}[{j}]") if block["type"] == "text" else f"[{block['type']}]")
    return "".join(parts)


def _typed_text(content: Any) -> str:
    """What the user typed in one message: its text blocks, without tool results."""
    if isinstance(content, str):
        return content
    return "".join(b["text"] for b in content if b.get("type") == "text" and isinstance(b.get("text"), str))


def _user_messages(content: Any, where: str) -> list[dict[str, Any]]:
    """One user message becomes `tool` messages for its tool results and user messages for its text."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []

    def flush() -> None:
        if pending:
            out.append({"role": "user", "content": "".join(pending)})
            pending.clear()

    for j, block in enumerate(_blocks(content, where)):
        if block["type"] == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise invalid_request(f"{where}[{j}]: a tool_result needs 'tool_use_id'", "messages")
            flush()
            result = block.get("content", "")
            text = blocks_text(result, f"{where}[{j}]") if result else ""
            out.append({"role": "tool", "tool_call_id": openai_tool_id(block["tool_use_id"]), "content": text})
        elif block["type"] == "text":
            pending.append(_text(block, f"{where}[{j}]"))
        else:
            pending.append(f"[{block['type']}]")
    flush()
    return out or [{"role": "user", "content": ""}]


def _assistant_message(content: Any, where: str) -> dict[str, Any]:
    text, calls = [], []
    for j, block in enumerate(_blocks(content, where)):
        kind = block["type"]
        if kind == "text":
            text.append(_text(block, f"{where}[{j}]"))
        elif kind == "thinking":
            text.append(f"{THINK_START}{block.get('thinking', '')}{THINK_END}")
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise invalid_request(f"{where}[{j}]: a tool_use needs 'name' and an object 'input'", "messages")
            call_id = openai_tool_id(str(block.get("id", "")))
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": block["name"], "arguments": block.get("input", {})},
                }
            )
        # redacted_thinking and server tool blocks carry nothing the policy generated here
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        message["tool_calls"] = calls
    return message


def convert_messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise invalid_request("'messages' must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": blocks_text(system, "system")})
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant", "system"):
            raise invalid_request(f"{where}.role is {role!r}; use user, assistant or system", "messages")
        if role == "user":
            out.extend(_user_messages(m.get("content"), f"{where}.content"))
        elif role == "assistant":
            out.append(_assistant_message(m.get("content"), f"{where}.content"))
        else:
            out.append({"role": "system", "content": blocks_text(m.get("content"), f"{where}.content")})
    return out


def convert_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid_request("'tools' must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise invalid_request(f"tools[{i}] needs a 'name'", "tools")
        spec = {
            "name": tool["name"],
            "description": tool.get("description") or "",
            "parameters": tool.get("input_schema") or {},
        }
        out.append({"type": "function", "function": spec})
    return out or None


def _number(body: dict[str, Any], name: str, hi: float) -> float | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= hi):
        raise invalid_request(f"{name}: must be a number between 0 and {hi}, got {value!r}", name)
    return value


def parse_messages_request(body: Any, default_model: str) -> MessagesRequest:
    if not isinstance(body, dict):
        raise invalid_request("the request body must be a JSON object")
    messages = convert_messages(body.get("system"), body.get("messages"))
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise invalid_request(f"max_tokens: must be an integer >= 1, got {max_tokens!r}", "max_tokens")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid_request("stop_sequences: must be a list of non-empty strings", "stop_sequences")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise invalid_request("stream: must be a boolean", "stream")
    temperature, top_p = _number(body, "temperature", 2.0), _number(body, "top_p", 1.0)
    params = GenParams(
        temperature=1.0 if temperature is None else float(temperature),
        top_p=1.0 if top_p is None else float(top_p),
        max_tokens=max_tokens,
        stop=list(stops),
    )
    tools = convert_tools(body.get("tools"))
    users = [m for m in body["messages"] if isinstance(m, dict) and m.get("role") == "user"]
    return MessagesRequest(
        model=body.get("model") if isinstance(body.get("model"), str) else default_model,
        messages=messages,
        tools=tools,
        params=params,
        stream=bool(body.get("stream")),
        system_text=blocks_text(body["system"], "system") if body.get("system") else "",
        user_text="\n".join(_typed_text(u.get("content")) for u in users),
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
