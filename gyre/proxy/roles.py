"""Which thread of a rollout a call belongs to, from what the harness sends (Claude Code's signals).

- sub-agent: header `x-claude-code-agent-id` (every sub-agent request carries it; the built-in harness
  sends `x-agent-id`, the same signal under a name of its own), or a sub-agent system prompt (a skill
  forked into its own agent context sends no header);
- summary (compaction): a user message asks for "a detailed summary of the conversation so far"
  (it stays there when Claude Code asks a cut-off summary to go on); it belongs to the thread it
  compacts (main or sub-agent);
- side: calls that are not the agent thinking, e.g. title generation: known wording, or a Claude
  Code request without tools. Excluded from training by default.
The same rules label every API's calls (`call_role`): the built-in harness (OpenAI API) compacts and
delegates with the same signals; a call that carries none of them is "main".
Codex CLI says it in the header `x-codex-turn-metadata` (JSON, on every request): `request_kind` is "turn"
for the agent's calls and "compaction" for a summary call (no tools; its last user message the compaction
prompt CODEX_SUMMARY_MARKER, observed with 0.171.0), `agent_name` is "/root" for the main agent (another name: a
sub-agent; Codex's multi-agent tools are off in harness=codex, so this is not observed).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

MAIN = "main"
MAIN_SUMMARY = "main_summary"
SUBAGENT = "subagent"
SUBAGENT_SUMMARY = "subagent_summary"
SIDE = "side"
ROLES = (MAIN, MAIN_SUMMARY, SUBAGENT, SUBAGENT_SUMMARY, SIDE)  # the same names as gyre/traj/tree.py

AGENT_ID_HEADER = "x-claude-code-agent-id"
AGENT_ID_HEADERS = (AGENT_ID_HEADER, "x-agent-id")  # Claude Code's; the built-in harness's
SUMMARY_MARKER = "Your task is to create a detailed summary of the conversation so far"
SUBAGENT_SYSTEM_MARKERS = ("You are an agent for Claude Code", "You are a file search specialist")
SIDE_MARKERS = ("Generate a concise, sentence-case title",)
CODEX_METADATA_HEADER = "x-codex-turn-metadata"
CODEX_ROOT_AGENT = "/root"
CODEX_SUMMARY_MARKER = "You are performing a CONTEXT CHECKPOINT COMPACTION"


def _header(headers: Mapping[str, str], name: str) -> str:
    for key, value in headers.items():
        if key.lower() == name:
            return value
    return ""


def is_claude_code(headers: Mapping[str, str]) -> bool:
    return _header(headers, "user-agent").startswith("claude-cli") or _header(headers, "x-app") == "cli"


def codex_metadata(headers: Mapping[str, str]) -> dict[str, Any]:
    """Codex's turn metadata header as a dict ({} when absent or not a JSON object)."""
    try:
        value = json.loads(_header(headers, CODEX_METADATA_HEADER) or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def call_role(headers: Mapping[str, str], system_text: str, user_text: str, has_tools: bool) -> str:
    """The role of one call of any API (`user_text`: all its user messages' text); see the module docstring."""
    codex = codex_metadata(headers)
    subagent = (
        any(_header(headers, h) for h in AGENT_ID_HEADERS)
        or any(m in system_text for m in SUBAGENT_SYSTEM_MARKERS)
        or codex.get("agent_name", CODEX_ROOT_AGENT) != CODEX_ROOT_AGENT
    )
    summary = SUMMARY_MARKER in user_text or CODEX_SUMMARY_MARKER in user_text
    if summary or codex.get("request_kind") == "compaction":
        return SUBAGENT_SUMMARY if subagent else MAIN_SUMMARY
    if any(m in system_text or m in user_text for m in SIDE_MARKERS):
        return SIDE
    if is_claude_code(headers) and not has_tools:
        return SIDE
    return SUBAGENT if subagent else MAIN


def chat_call_role(headers: Mapping[str, str], messages: list[dict[str, Any]], has_tools: bool) -> str:
    """The role of one OpenAI Chat Completions call, from its system and user messages' text."""
    return call_role(headers, _texts(messages, "system"), _texts(messages, "user"), has_tools)


def _texts(messages: list[dict[str, Any]], role: str) -> str:
    """The text of every `role` message (string content, or the text parts of a list)."""
    out = []
    for m in messages:
        if m.get("role") != role:
            continue
        content = m.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out += [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return "\n".join(out)
