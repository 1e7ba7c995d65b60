"""OpenAI Responses API: request -> the proxy's chat messages, and reply -> response object or SSE events.

Pure functions, no I/O. `input` items become the OpenAI-style messages the chat template and the TITO
renderer speak: `instructions` leads as the system message, system/developer messages stay in place,
the items of one model turn (`reasoning`, an assistant `message`, `function_call`s) fold back into one
assistant message (reasoning as `<think>...</think>`, exactly as the model generated it), and
`function_call_output` items become `tool` messages. The proxy hands out function call ids
`call_<call>_<n>`, so a turn re-sent by the harness is found again in the call log and spliced in as
the ids generated (gyre.proxy.tito).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter

from gyre.model.chat_template import THINK_END, THINK_START
from gyre.proxy.calls import GenParams
from gyre.proxy.errors import validation_error
from gyre.proxy.responses_schema import Item, ResponsesBody, Tool
from gyre.proxy.schema_util import validate_in_slices

LISTS = {"input": TypeAdapter(list[Item]), "tools": TypeAdapter(list[Tool])}
MODEL_TURN_ITEMS = ("reasoning", "function_call")


@dataclass
class ResponsesRequest:
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    params: GenParams
    stream: bool = False
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response object repeats

    @property
    def tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools or []]


def content_text(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p["text"] if "text" in p else p.get("refusal", "") for p in content)


def _reasoning_text(item: dict[str, Any]) -> str:
    """What the model thought: the full text when sent back, else its summary (the proxy sends both alike)."""
    parts = item.get("content") or item.get("summary") or []
    return "".join(p["text"] for p in parts)


def _open_turn(out: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message the current model turn folds into (a new one after anything else)."""
    if not out or out[-1]["role"] != "assistant" or out[-1].get("_closed"):
        out.append({"role": "assistant", "content": ""})
    return out[-1]


def _add_item(out: list[dict[str, Any]], item: dict[str, Any]) -> None:
    kind = item.get("type", "message")
    if kind == "reasoning":
        turn = _open_turn(out)
        if turn["content"] or turn.get("tool_calls"):  # a second thought starts a second turn
            turn["_closed"] = True
            turn = _open_turn(out)
        turn["content"] += f"{THINK_START}{_reasoning_text(item)}{THINK_END}"
    elif kind == "function_call":
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"] or "{}"}}  # fmt: skip
        _open_turn(out).setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        out.append({"role": "tool", "tool_call_id": item["call_id"], "content": content_text(item["output"])})
    elif item["role"] == "assistant":
        turn = _open_turn(out)
        if turn.get("tool_calls"):  # text after calls: the model's next turn
            turn["_closed"] = True
            turn = _open_turn(out)
        turn["content"] += content_text(item["content"])
    else:
        role = "user" if item["role"] == "user" else "system"
        out.append({"role": role, "content": content_text(item["content"])})


def convert_input(instructions: str | None, items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`instructions` and `input` as validated by `ResponsesBody` -> the proxy's OpenAI-style messages."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in [{"role": "user", "content": items}] if isinstance(items, str) else items:
        _add_item(out, item)
    for message in out:
        message.pop("_closed", None)
    return out


def convert_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    out = []
    for tool in tools or []:
        spec = {"name": tool["name"], "description": tool.get("description") or "",
                "parameters": tool.get("parameters") or {}}  # fmt: skip
        out.append({"type": "function", "function": spec})
    return out or None


def parse_responses_request(body: Any, default_model: str) -> ResponsesRequest:
    """A validated, converted request (gyre.proxy.responses_schema); raises a 400 ProxyError otherwise."""
    req, errors = validate_in_slices(ResponsesBody, body, LISTS)
    if errors or req is None:
        raise validation_error(errors)
    params = GenParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        max_tokens=req.max_output_tokens,
        tool_calls=req.tool_choice != "none",
        parallel_tool_calls=req.parallel_tool_calls is not False,
    )
    echo = {
        "instructions": req.instructions,
        "tools": body.get("tools") or [],
        "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "store": bool(req.store),
    }
    return ResponsesRequest(
        model=req.model or default_model,
        messages=convert_input(req.instructions, body["input"]),
        tools=convert_tools(body.get("tools")),
        params=params,
        stream=bool(req.stream),
        echo=echo,
    )


# ---------------------------------------------------------------- replies


def output_items(
    call_id: int, content: str, tool_calls: list[dict[str, Any]], tool_call_ids: list[str]
) -> list[dict[str, Any]]:
    """The output items of one reply: a leading `<think>...</think>` becomes a reasoning item (its text as
    both content and summary), the rest a message, each tool call a function_call."""
    items: list[dict[str, Any]] = []
    if content.startswith(THINK_START) and THINK_END in content:
        thinking, content = content[len(THINK_START) :].split(THINK_END, 1)
        items.append({"id": f"rs_gyre{call_id}", "type": "reasoning",
                      "summary": [{"type": "summary_text", "text": thinking}],
                      "content": [{"type": "reasoning_text", "text": thinking}]})  # fmt: skip
    if content:
        part = {"type": "output_text", "text": content, "annotations": [], "logprobs": []}
        items.append({"id": f"msg_gyre{call_id}", "type": "message", "role": "assistant",
                      "status": "completed", "content": [part]})  # fmt: skip
    for n, (tool_id, call) in enumerate(zip(tool_call_ids, tool_calls, strict=True)):
        items.append({"id": f"fc_gyre{call_id}_{n}", "type": "function_call", "status": "completed",
                      "call_id": tool_id, "name": call["name"],
                      "arguments": json.dumps(call["arguments"], ensure_ascii=False)})  # fmt: skip
    return items


def usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """input_tokens is the whole rendered prompt: harnesses budget their context with it."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def response_body(
    resp_id: str, created: float, req: ResponsesRequest, items: list[dict[str, Any]], finish: str,
    use: dict[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    """The response object; `use` None for the in-progress snapshot streamed first."""
    status = "in_progress" if use is None else "incomplete" if finish == "length" else "completed"
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": resp_id, "object": "response", "created_at": created, "status": status, "error": None,
        "incomplete_details": incomplete, "model": req.model, "output": items, "usage": use,
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "reasoning": {"effort": None, "summary": None},
        "previous_response_id": None, "user": None, **req.echo,
    }  # fmt: skip


def _opened(item: dict[str, Any]) -> dict[str, Any]:
    """An item as `response.output_item.added` shows it: before any of its text or arguments."""
    if item["type"] == "message":
        return {**item, "status": "in_progress", "content": []}
    if item["type"] == "function_call":
        return {**item, "status": "in_progress", "arguments": ""}
    return {**item, "summary": [], "content": []}


def _item_events(i: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    """Events of one output item, between its `output_item.added` and `output_item.done`."""
    where = {"item_id": item["id"], "output_index": i}
    if item["type"] == "function_call":
        args = item["arguments"]
        deltas = [args[k : k + 512] for k in range(0, len(args), 512)] or [""]
        return [
            *({"type": "response.function_call_arguments.delta", **where, "delta": d} for d in deltas),
            {"type": "response.function_call_arguments.done", **where, "name": item["name"], "arguments": args},
        ]
    if item["type"] == "reasoning":
        text = item["content"][0]["text"]
        return [
            {"type": "response.reasoning_text.delta", **where, "content_index": 0, "delta": text},
            {"type": "response.reasoning_text.done", **where, "content_index": 0, "text": text},
        ]
    part = item["content"][0]
    where = {**where, "content_index": 0}
    return [
        {"type": "response.content_part.added", **where, "part": {**part, "text": ""}},
        {"type": "response.output_text.delta", **where, "delta": part["text"], "logprobs": []},
        {"type": "response.output_text.done", **where, "text": part["text"], "logprobs": []},
        {"type": "response.content_part.done", **where, "part": part},
    ]


def sse_events(start: dict[str, Any], done: dict[str, Any]) -> list[dict[str, Any]]:
    """The events OpenAI streams for a response (`start` the in-progress snapshot, `done` the final one),
    numbered by `sequence_number`. A reply cut at max_output_tokens still ends with `response.completed`
    (its response's status "incomplete"): Codex treats a `response.incomplete` event as a broken stream and
    retries the call, and the SDK's `responses.stream()` helper only takes `response.completed`."""
    events = [{"type": "response.created", "response": start}, {"type": "response.in_progress", "response": start}]
    for i, item in enumerate(done["output"]):
        events.append({"type": "response.output_item.added", "output_index": i, "item": _opened(item)})
        events.extend(_item_events(i, item))
        events.append({"type": "response.output_item.done", "output_index": i, "item": item})
    events.append({"type": "response.completed", "response": done})
    return [{**e, "sequence_number": n} for n, e in enumerate(events)]
