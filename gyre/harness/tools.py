"""The built-in harness's tools: schemas, execution inside the workspace, and result texts.

Demonstrations (gyre/harness/demos.py) build their tool messages with the same text functions, so a
warm-started model sees exactly what the harness will show it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, NamedTuple

from gyre.tasks.checker import run_checks

SYSTEM_PROMPT = "You are a coding agent. Use the tools to do the task, then call finish."
MAX_READ_CHARS = 2000
MAX_WRITE_CHARS = 20000
VISIBLE_CHECK_PYTHON_TIMEOUT_S = 5.0


def _tool(name: str, description: str, *string_params: str) -> dict[str, Any]:
    parameters: dict[str, Any] = {"type": "object", "properties": {p: {"type": "string"} for p in string_params}}
    if string_params:
        parameters["required"] = list(string_params)
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


TOOL_SCHEMAS: list[dict[str, Any]] = [
    _tool("write_file", "Write a file.", "path", "content"),
    _tool("read_file", "Read a file.", "path"),
    _tool("list_files", "List files."),
    _tool("run_checks", "Check the work."),
    _tool("finish", "End the task."),
]


class ToolError(Exception):
    """A bad tool call; its message goes back to the model as the tool result."""


class ToolResult(NamedTuple):  # not a dataclass: `dataclasses` costs ~10 ms of harness start-up
    text: str
    finished: bool = False
    error: bool = False


def wrote_text(path: str) -> str:
    return f"wrote {path}"


def read_text(content: str) -> str:
    if len(content) > MAX_READ_CHARS:
        return content[:MAX_READ_CHARS] + "\n[truncated]"
    return content or "(empty)"


def files_text(paths: list[str]) -> str:
    return "\n".join(paths) or "(no files)"


def checks_text(results: list[dict[str, Any]]) -> str:
    return "\n".join(f"{r['name']}: {'ok' if r['passed'] else 'fail'}" for r in results) or "(no checks)"


def error_text(message: str) -> str:
    return f"error: {message}"


def parse_arguments(raw: Any) -> dict[str, Any]:
    """OpenAI sends arguments as a JSON string; accept an object too."""
    if isinstance(raw, dict):
        return raw
    try:
        args = json.loads(raw) if isinstance(raw, str) and raw.strip() else {}
    except json.JSONDecodeError as e:
        raise ToolError(f"arguments are not valid JSON ({e.msg})") from e
    if not isinstance(args, dict):
        raise ToolError("arguments must be a JSON object")
    return args


def resolve_in_workspace(workspace: Path, rel: Any) -> Path:
    """The absolute path of `rel` inside the workspace; anything escaping it (.., absolute, symlink) fails."""
    if not isinstance(rel, str) or not rel.strip():
        raise ToolError("path must be a non-empty string")
    root = workspace.resolve()
    target = (root / rel).resolve()
    if target == root or not target.is_relative_to(root):
        raise ToolError(f"path {rel} is outside the workspace")
    return target


def _string_arg(args: dict[str, Any], key: str) -> str:
    value = args.get(key)
    if not isinstance(value, str):
        raise ToolError(f"argument {key} must be a string")
    return value


def _execute(workspace: Path, name: str, args: dict[str, Any], visible_checks: list[dict], tool_delay: float) -> str:
    if name == "write_file":
        path, content = _string_arg(args, "path"), _string_arg(args, "content")
        if len(content) > MAX_WRITE_CHARS:
            raise ToolError(f"content longer than {MAX_WRITE_CHARS} characters")
        target = resolve_in_workspace(workspace, path)
        if target.is_dir():
            raise ToolError(f"{path} is a directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
        return wrote_text(path)
    if name == "read_file":
        path = _string_arg(args, "path")
        target = resolve_in_workspace(workspace, path)
        if not target.is_file():
            raise ToolError(f"no file {path}")
        return read_text(target.read_text(errors="replace"))
    if name == "list_files":
        root = workspace.resolve()
        return files_text(sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()))
    if name == "run_checks":
        time.sleep(tool_delay)
        return checks_text(run_checks(visible_checks, workspace, VISIBLE_CHECK_PYTHON_TIMEOUT_S))
    raise ToolError(f"unknown tool {name}; use one of {', '.join(t['function']['name'] for t in TOOL_SCHEMAS)}")


def execute_tool(
    workspace: Path, name: str, raw_arguments: Any, visible_checks: list[dict[str, Any]], tool_delay: float = 0.0
) -> ToolResult:
    """Run one tool call in the workspace. `finish` ends the episode; errors become result texts."""
    if name == "finish":
        return ToolResult("", finished=True)
    try:
        return ToolResult(_execute(workspace, name, parse_arguments(raw_arguments), visible_checks, tool_delay))
    except ToolError as e:
        return ToolResult(error_text(str(e)), error=True)
    except OSError as e:
        return ToolResult(error_text(f"{type(e).__name__}: {e.strerror or e}"), error=True)
