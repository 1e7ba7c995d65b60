"""Each harness kind's requests as the proxy sees them: a task's first request (for the preflight's context
check) and its reference solution as that harness would send and receive it (warm-start demonstrations).

The built-in harness's format is its own (gyre/harness/demos.py). Claude Code's requests are recorded from
the pinned CLI (gyre/harness/templates/, by tools/record_harness_templates.py) with the task prompt, the
workspace and the date as placeholders; a demonstration fills them in, answers with Anthropic tool_use
blocks for Claude Code's Bash tool (the one tool `--bare` and the full tool set share that writes a
file), and goes through the proxy's own request conversion (gyre/proxy/anthropic_api.py), so the
warm start trains on the token ids the proxy renders for those requests. mini-swe-agent's chat requests
are recorded the same way (mini_swe_agent.json: the stock config; mini_swe_agent_bare.json: harness.bare's
compact templates); its replies are a THOUGHT and one bash block. Codex CLI's Responses API requests are
recorded the same way (codex.json: its stock prompt; codex_bare.json: harness.bare's one-line instructions) and
converted by the proxy's Responses conversion (gyre/proxy/responses_api.py); its replies are exec_command
function calls answered with the output Codex sends back for a command without output, then a short message.
"""

from __future__ import annotations

import copy
import functools
import json
import platform
import shlex
import time
from pathlib import Path
from typing import Any

from gyre.harness.demos import Demonstration
from gyre.proxy.anthropic_api import convert_messages, convert_tools
from gyre.proxy.responses_api import convert_input
from gyre.proxy.responses_api import convert_tools as convert_response_tools
from gyre.sandbox.base import WORKSPACE
from gyre.tasks.task import Task

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
MARKS = {"prompt": "@@GYRE_PROMPT@@", "home": "@@GYRE_HOME@@", "slug": "@@GYRE_CWD_SLUG@@", "cwd": "@@GYRE_CWD@@",
         "date": "@@GYRE_DATE@@", "kernel_version": "@@GYRE_KERNEL_VERSION@@",
         "kernel_release": "@@GYRE_KERNEL_RELEASE@@"}  # fmt: skip
CLAUDE_HOME = "/run/gyre/harness/claude-home"  # gyre.harness.claude_code: HOME beside the result file
CODEX_HOME = "/run/gyre/harness/codex-home"  # gyre.harness.codex: CODEX_HOME beside the result file
CLAUDE_DONE = "Done."


def _map_strings(value: Any, fn: Any) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    return value


def _values(prompt: str, cwd: str, home: str, date: str) -> dict[str, str]:
    """mini-swe-agent's prompt names the kernel (platform.uname()): this machine's, where the harness runs."""
    uname = platform.uname()
    return {"prompt": prompt, "home": home, "slug": cwd.replace("/", "-"), "cwd": cwd, "date": date,
            "kernel_version": uname.version, "kernel_release": uname.release}  # fmt: skip


def placeholders(body: Any, prompt: str, cwd: str, home: str, date: str) -> Any:
    """A recorded body with the per-run parts (task prompt, HOME, workspace, date) replaced by marks."""
    values = _values(prompt, cwd, home, date)

    def sub(s: str) -> str:
        for key, mark in MARKS.items():
            s = s.replace(values[key], mark)
        return s

    return _map_strings(body, sub)


def fill(body: Any, prompt: str, cwd: str = WORKSPACE, date: str | None = None, home: str = CLAUDE_HOME) -> Any:
    values = _values(prompt, cwd, home, date or time.strftime("%Y-%m-%d"))

    def sub(s: str) -> str:
        for key, mark in MARKS.items():
            s = s.replace(mark, values[key])
        return s

    return _map_strings(body, sub)


@functools.cache
def claude_code_template(bare: bool) -> dict[str, Any]:
    path = TEMPLATE_DIR / ("claude_code_bare.json" if bare else "claude_code.json")
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python -m tools.record_harness_templates`")
    return json.loads(path.read_text())


def _claude_tool_result(template: dict[str, Any]) -> dict[str, Any]:
    """The tool_result block Claude Code sent back for a Bash command without output."""
    last = template["after_tool"]["messages"][-1]["content"]
    return next(b for b in last if b.get("type") == "tool_result")


def claude_code_body(task: Task, bare: bool, date: str | None = None, cwd: str = WORKSPACE) -> dict[str, Any]:
    """The Messages API body of the task's first request, as the pinned CLI sends it."""
    return fill(copy.deepcopy(claude_code_template(bare)["first"]), task.prompt, cwd, date)


def bash_command(call: dict[str, Any]) -> str:
    """A built-in reference tool call as one shell command (Claude Code's Bash tool)."""
    args = call["arguments"]
    if call["name"] == "write_file":
        return f"printf %s {shlex.quote(args['content'])} > {shlex.quote(args['path'])}"
    if call["name"] == "read_file":
        return f"cat {shlex.quote(args['path'])}"
    raise ValueError(f"no shell command for reference tool call {call['name']!r}")


def claude_code_demonstration(task: Task, bare: bool, date: str | None = None) -> Demonstration:
    """The task's reference solution as a Claude Code session: one Bash tool_use per file written, each
    answered as the CLI answers a command without output, then a short end_turn text."""
    template = claude_code_template(bare)
    body = claude_code_body(task, bare, date)
    result = _claude_tool_result(template)
    messages = list(body["messages"])
    steps = [c for c in task.solution if c["name"] == "write_file"]
    if not steps or any(c["name"] not in ("write_file", "finish", "run_checks") for c in task.solution):
        raise ValueError(f"task {task.task_id} ({task.family}): Claude Code demonstrations cover tasks that only "
                         f"write files (write_value, echo_files); set warm_start.families")  # fmt: skip
    for i, call in enumerate(steps):
        use_id = f"toolu_demo_{i}"
        messages.append(
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": use_id, "name": "Bash", "input": {"command": bash_command(call)}}]}
        )  # fmt: skip
        messages.append({"role": "user", "content": [{**result, "tool_use_id": use_id}]})
    messages.append({"role": "assistant", "content": [{"type": "text", "text": CLAUDE_DONE}]})
    return Demonstration(convert_messages(body.get("system"), messages), convert_tools(body.get("tools")) or [])


def claude_code_first_request(task: Task, bare: bool) -> Demonstration:
    body = claude_code_body(task, bare)
    return Demonstration(convert_messages(body.get("system"), body["messages"]), convert_tools(body.get("tools")) or [])


@functools.cache
def mini_template(bare: bool = False) -> dict[str, Any]:
    path = TEMPLATE_DIR / ("mini_swe_agent_bare.json" if bare else "mini_swe_agent.json")
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python -m tools.record_harness_templates`")
    return json.loads(path.read_text())


def mini_first_request(task: Task, bare: bool = False) -> Demonstration:
    """mini-swe-agent's first chat request: its system prompt and its instance prompt around the task."""
    return Demonstration(fill(copy.deepcopy(mini_template(bare)["first"]["messages"]), task.prompt), [])


def mini_demonstration(task: Task, bare: bool = False) -> Demonstration:
    """The reference solution as mini-swe-agent replies: per file written a THOUGHT and one bash block,
    answered with the observation of a command without output, then the submit command."""
    template = mini_template(bare)
    write, submit = template["replies"]
    observation = template["after_command"]["messages"][-1]
    steps = [c for c in task.solution if c["name"] == "write_file"]
    if not steps or any(c["name"] not in ("write_file", "finish", "run_checks") for c in task.solution):
        raise ValueError(f"task {task.task_id} ({task.family}): mini-swe-agent demonstrations cover tasks that "
                         f"only write files (write_value, echo_files); set warm_start.families")  # fmt: skip
    messages = list(mini_first_request(task, bare).messages)
    for call in steps:
        messages.append({"role": "assistant", "content": write.replace(template["command"], bash_command(call))})
        messages.append(dict(observation))
    messages.append({"role": "assistant", "content": submit})
    return Demonstration(messages, [])


@functools.cache
def codex_template(bare: bool) -> dict[str, Any]:
    path = TEMPLATE_DIR / ("codex_bare.json" if bare else "codex.json")
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python -m tools.record_harness_templates --only codex`")
    return json.loads(path.read_text())


def codex_body(task: Task, bare: bool, date: str | None = None, cwd: str = WORKSPACE) -> dict[str, Any]:
    """The Responses API body of the task's first request, as the pinned CLI sends it."""
    return fill(copy.deepcopy(codex_template(bare)["first"]), task.prompt, cwd, date, CODEX_HOME)


def codex_first_request(task: Task, bare: bool) -> Demonstration:
    body = codex_body(task, bare)
    return Demonstration(
        convert_input(body.get("instructions"), body["input"]), convert_response_tools(body["tools"]) or []
    )


def codex_demonstration(task: Task, bare: bool, date: str | None = None) -> Demonstration:
    """The task's reference solution as a Codex session: one exec_command call per file written, each answered
    with the output Codex sent back for a command without output, then a short message."""
    template = codex_template(bare)
    body = codex_body(task, bare, date)
    output = template["after_command"]["input"][-1]
    steps = [c for c in task.solution if c["name"] == "write_file"]
    if not steps or any(c["name"] not in ("write_file", "finish", "run_checks") for c in task.solution):
        raise ValueError(f"task {task.task_id} ({task.family}): Codex demonstrations cover tasks that only "
                         f"write files (write_value, echo_files); set warm_start.families")  # fmt: skip
    items = list(body["input"])
    for i, call in enumerate(steps):
        call_id = f"call_demo_{i}"
        items.append({"type": "function_call", "call_id": call_id, "name": "exec_command",
                      "arguments": json.dumps({"cmd": bash_command(call)})})  # fmt: skip
        items.append({**output, "call_id": call_id})
    items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": CLAUDE_DONE}]})
    return Demonstration(convert_input(body.get("instructions"), items), convert_response_tools(body["tools"]) or [])
