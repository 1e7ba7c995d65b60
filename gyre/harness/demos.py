"""Demonstrations: a task's reference solution as the OpenAI message list the harness would produce.

Tool results are predicted with the harness's own text functions on an in-memory copy of the
workspace (no subprocesses, so thousands of demos take a moment); tests replay the tool calls
through the harness's real tool execution and compare the texts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from gyre.harness.tools import SYSTEM_PROMPT, TOOL_SCHEMAS, checks_text, files_text, read_text, wrote_text
from gyre.model.chat_template import render_text
from gyre.tasks.suite import sample_tasks
from gyre.tasks.task import Task


def _expected_result(task: Task, files: dict[str, str], name: str, args: dict[str, Any]) -> str:
    if name == "write_file":
        files[args["path"]] = args["content"]
        return wrote_text(args["path"])
    if name == "read_file":
        return read_text(files[args["path"]])
    if name == "list_files":
        return files_text(sorted(files))
    if name == "run_checks":  # a reference solution passes its visible checks
        return checks_text([{"name": c["name"], "passed": True} for c in task.visible_checks])
    raise ValueError(f"task {task.task_id}: solution uses unknown tool {name!r}")


class Demonstration(NamedTuple):
    messages: list[dict[str, Any]]  # OpenAI format
    tools: list[dict[str, Any]]  # the tool schemas the harness sends with every request


def demonstration(task: Task) -> Demonstration:
    """system, user, then per turn an assistant tool call and its tool result; ends with finish."""
    if not task.solution or task.solution[-1]["name"] != "finish":
        raise ValueError(f"task {task.task_id} has no reference solution ending with finish; cannot demonstrate it")
    files = dict(task.files)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task.prompt},
    ]
    for i, call in enumerate(task.solution):
        call_id = f"call_{i}"
        function = {"name": call["name"], "arguments": json.dumps(call["arguments"])}
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call_id, "type": "function", "function": function}],
            }
        )
        if call["name"] != "finish":
            text = _expected_result(task, files, call["name"], call["arguments"])
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
    return Demonstration(messages, TOOL_SCHEMAS)


def tokenizer_corpus(n: int, seed: int, families: Sequence[str] | None = None) -> Iterator[str]:
    """Rendered demonstrations (system prompt, tool schemas, turns) for training the BPE tokenizer."""
    for task in sample_tasks(families, n, seed):
        yield render_text(*demonstration(task))
