"""The chat template, as segments, so that earlier assistant turns can be spliced in as token ids.

Prompt = concatenation of segments. A `str` segment is tokenized as text (special tokens included);
an `AssistantTurn` is one earlier assistant reply, which the proxy replaces by the token ids the
engine generated for it (token-in/token-out) and only falls back to `assistant_body` text for
replies it never produced. Each segment is tokenized on its own, so a conversation's prefix keeps
the same ids as it grows.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
THINK_START = "<think>"
THINK_END = "</think>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END, TOOL_CALL_START, TOOL_CALL_END, THINK_START, THINK_END)
GENERATION_PROMPT = f"{IM_START}assistant\n"

CHAT_TEMPLATE_JINJA = (  # must render exactly as render_segments does (tested, with HF's jinja settings)
    "{%- set nl = '\\n' -%}"
    "{%- set sys = messages[0].content if messages and messages[0].role == 'system' else '' -%}"
    "{%- if sys or tools -%}{{ '<|im_start|>system' + nl + (sys or '') }}"
    "{%- if tools -%}{{ nl + nl + '# Tools' + nl }}"
    "{%- for t in tools -%}{%- set f = t.function if t.function is defined else t -%}"
    "{%- set p = f.parameters if f.parameters is defined else {} -%}{{ f.name + '(' }}"
    "{%- for k in (p.properties or {}) -%}{{ k }}{%- if k not in (p.required or []) -%}?{%- endif -%}"
    "{%- if not loop.last -%}, {% endif -%}{%- endfor -%})"
    "{%- if f.description -%}{{ ': ' + (f.description.split(nl)[0] | trim) }}{%- endif -%}{{ nl }}"
    "{%- endfor -%}{%- endif -%}{{ '<|im_end|>' + nl }}{%- endif -%}"
    "{%- for m in messages -%}{%- if not (loop.first and m.role == 'system') -%}"
    "{{ '<|im_start|>' + m.role + nl + (m.content or '') }}"
    "{%- if m.tool_calls -%}{%- for c in m.tool_calls -%}{{ '<tool_call>' }}"
    "{{ '{\"name\": ' + (c.function.name | tojson) + ', \"arguments\": ' + c.function.arguments + '}' }}"
    "{{ '</tool_call>' }}{%- endfor -%}{%- endif -%}{{ '<|im_end|>' + nl }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant' + nl }}{%- endif -%}"
)


@dataclass(frozen=True)
class AssistantTurn:
    """An earlier assistant reply inside a prompt; `index` is its position in `messages`."""

    index: int
    message: dict[str, Any]


Segment = str | AssistantTurn


class TemplateError(ValueError):
    """A message the template cannot render (bad role, bad content type)."""


def content_text(content: Any) -> str:
    """OpenAI content: a string, None, or a list of parts of which text parts are kept."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    raise TemplateError(f"content must be a string or a list of parts, got {type(content).__name__}")


def tool_call_json(name: str, arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise TemplateError(f"tool call arguments are not JSON: {e}") from e
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


def assistant_body(message: dict[str, Any]) -> str:
    """Text of an assistant reply as the model would have generated it, ending with IM_END."""
    text = content_text(message.get("content"))
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        text += f"{TOOL_CALL_START}{tool_call_json(fn.get('name', ''), fn.get('arguments', {}))}{TOOL_CALL_END}"
    return text + IM_END


def _param_list(spec: dict[str, Any]) -> str:
    params = spec.get("parameters") or {}
    props = params.get("properties") or {}
    required = set(params.get("required") or [])
    return ", ".join(name if name in required else f"{name}?" for name in props)


def tools_block(tools: list[dict[str, Any]] | None) -> str:
    """Tools as compact signatures, `name(arg, optional?): description`, one per line.

    Full JSON schemas cost tokens on every call (Claude Code sends ~64 KB of them); the model
    answers with JSON arguments either way.
    """
    if not tools:
        return ""
    lines = []
    for tool in tools:
        spec = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(spec, dict) or "name" not in spec:
            raise TemplateError("each tool must be {'type': 'function', 'function': {'name': ...}}")
        desc = str(spec.get("description") or "").strip().splitlines()
        lines.append(f"{spec['name']}({_param_list(spec)})" + (f": {desc[0]}" if desc else ""))
    return "\n\n# Tools\n" + "\n".join(lines) + "\n"


def render_segments(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[Segment]:
    segments: list[Segment] = []
    start = 0
    system = ""
    if messages and messages[0].get("role") == "system":
        system = content_text(messages[0].get("content"))
        start = 1
    if system or tools:
        segments.append(f"{IM_START}system\n{system}{tools_block(tools)}{IM_END}\n")
    for i in range(start, len(messages)):
        m = messages[i]
        role = m.get("role")
        if role == "assistant":
            segments.append(GENERATION_PROMPT)
            segments.append(AssistantTurn(i, m))
            segments.append("\n")
        elif role in ("user", "tool", "system"):
            segments.append(f"{IM_START}{role}\n{content_text(m.get('content'))}{IM_END}\n")
        else:
            raise TemplateError(f"message {i} has unknown role {role!r}; use system, user, assistant or tool")
    if add_generation_prompt:
        segments.append(GENERATION_PROMPT)
    return segments


def render_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    """The whole prompt as text, assistant turns rendered from their messages (for SFT and docs)."""
    out = []
    for seg in render_segments(messages, tools):
        out.append(assistant_body(seg.message) if isinstance(seg, AssistantTurn) else seg)
    return "".join(out)


_CALL_RE = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.S)


def reply_text(text: str) -> str:
    """Generated text up to the end of the turn, tool-call markup kept as text (a reply that may call no tool)."""
    return text.split(IM_END, 1)[0]


def parse_assistant_text(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split generated text into (content, tool calls); malformed calls stay in the content."""
    text = text.split(IM_END, 1)[0]
    calls: list[dict[str, Any]] = []
    content_parts: list[str] = []
    pos = 0
    for match in _CALL_RE.finditer(text):
        content_parts.append(text[pos : match.start()])
        pos = match.end()
        try:
            obj = json.loads(match.group(1))
            name = obj["name"]
            args = obj.get("arguments", {})
            if not isinstance(name, str) or not isinstance(args, dict):
                raise ValueError("bad tool call shape")
        except (ValueError, KeyError, TypeError):
            content_parts.append(match.group(0))
            continue
        calls.append({"name": name, "arguments": args})
    content_parts.append(text[pos:])
    return "".join(content_parts), calls
