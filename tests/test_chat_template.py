import json

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gyre.model.chat_template import (
    CHAT_TEMPLATE_JINJA,
    AssistantTurn,
    TemplateError,
    parse_assistant_text,
    render_segments,
    render_text,
)

pytestmark = pytest.mark.unit

TOOLS = [
    {"type": "function", "function": {"name": "write_file", "description": "Write a file.\nMore text.",
     "parameters": {"type": "object", "properties": {"path": {}, "content": {}, "mode": {}},
                    "required": ["path", "content"]}}},
    {"type": "function", "function": {"name": "finish", "parameters": {"type": "object", "properties": {}}}},
]  # fmt: skip
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Create a.txt"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "write_file", "arguments": '{"path": "a.txt", "content": "x"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "wrote a.txt"},
    {"role": "assistant", "content": "done"},
]  # fmt: skip


def test_python_rendering_matches_the_jinja_template_shipped_with_the_tokenizer():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # as transformers renders it
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False)
    expected = env.from_string(CHAT_TEMPLATE_JINJA).render(messages=MESSAGES, tools=TOOLS, add_generation_prompt=True)
    assert render_text(MESSAGES, TOOLS) == expected
    assert "write_file(path, content, mode?): Write a file.\n" in expected


def test_assistant_turns_are_separate_segments():
    segs = render_segments(MESSAGES, TOOLS)
    turns = [s for s in segs if isinstance(s, AssistantTurn)]
    assert [t.index for t in turns] == [2, 4]


def test_unknown_role_is_a_clear_error():
    with pytest.raises(TemplateError, match="unknown role 'robot'"):
        render_segments([{"role": "robot", "content": "hi"}])


def test_parse_tool_calls_and_keep_malformed_ones_as_text():
    text = 'ok<tool_call>{"name": "finish", "arguments": {}}</tool_call><tool_call>{bad</tool_call><|im_end|>'
    content, calls = parse_assistant_text(text)
    assert calls == [{"name": "finish", "arguments": {}}]
    assert content == "ok<tool_call>{bad</tool_call>"
