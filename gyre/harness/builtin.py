"""The built-in harness: a standalone multi-turn tool-using agent loop over the OpenAI Chat API.

It is a black box to Gyre, like any other harness: it knows the proxy only as an OpenAI base URL
(`http://host:port/v1`) plus its rollout's key (env GYRE_API_KEY, sent as `Authorization: Bearer`) and
an `X-Rollout-Id` header, works only inside its workspace, and
writes a small result file (rewritten after every turn, so a killed run still reports its turns).
Standard library only, to start in ~60 ms.

Like real harnesses it makes a rollout a tree of context paths (each off unless asked for): with
--subagents, after its first turn the main agent hands a task's delegable sub-tasks (`delegation` in the
task file) to sub-agents, whose calls carry X-Agent-Id and whose results come back into its context; with
--compact-tokens it compacts a thread that reaches that length (a summary call, then the thread goes on from
the summary, the task and its last turn); with --reply-retries it re-sends a request whose reply has no
usable tool call. The proxy labels the calls subagent and main_summary (gyre/proxy/roles.py).

    python -m gyre.harness.builtin --base-url http://127.0.0.1:8000/v1 --workspace ws \
        --task-file task.json --result-file result.json --rollout-id r1 --max-turns 8
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from gyre.harness.tools import SYSTEM_PROMPT, TOOL_SCHEMAS, ToolError, execute_tool, parse_arguments

RETRYABLE = {408, 409, 429, 500, 502, 503, 504, 529}
TOOL_NAMES = frozenset(t["function"]["name"] for t in TOOL_SCHEMAS)
# The proxy labels calls by these (gyre/proxy/roles.py): a sub-agent's calls carry the header, a summary call's
# last user message the summary request; a test checks that the proxy reads them as subagent and main_summary.
AGENT_ID_HEADER = "X-Agent-Id"
SUMMARY_PROMPT = "Your task is to create a detailed summary of the conversation so far. Reply with text only."
SUBAGENTS_PREFIX = "Done by sub-agents:"
CHARS_PER_TOKEN = 3  # to estimate the tokens of messages added since the last reply's usage
CONTINUED_PREFIX = "This session is being continued from a previous conversation that ran out of context. Summary:"


class Reply(NamedTuple):
    message: dict[str, Any]  # the assistant message
    prompt_tokens: int  # the request's length in tokens (usage; 0 when missing)
    tokens: int  # the conversation's length after it: prompt + completion tokens


class ApiError(Exception):
    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


def _seconds(header: str | None) -> float | None:
    try:
        return float(header) if header else None
    except ValueError:  # an HTTP date: fall back to our own backoff
        return None


class ChatClient:
    """POST {base_url}/chat/completions with retries on 429/5xx and connection errors."""

    def __init__(self, base_url: str, rollout_id: str, timeout_s: float, max_retries: int) -> None:
        url = urlsplit(base_url.rstrip("/"))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise SystemExit(f"--base-url must look like http://host:port/v1, got {base_url!r}")
        conn_cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        self._connect = lambda: conn_cls(url.hostname, url.port, timeout=timeout_s)
        self._conn: http.client.HTTPConnection | None = None
        self.path = url.path + "/chat/completions"
        key = os.environ.get("GYRE_API_KEY") or "none"
        self.headers = {
            "Content-Type": "application/json",
            "Authorization": f"Bearer {key}",
            "X-Rollout-Id": rollout_id,
        }
        self.max_retries = max_retries

    def _post_once(self, body: bytes, headers: dict[str, str]) -> Reply:
        if self._conn is None:
            self._conn = self._connect()
        try:
            self._conn.request("POST", self.path, body=body, headers={**self.headers, **headers})
            resp = self._conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            self._conn.close()
            self._conn = None
            raise ApiError(f"connection error: {type(e).__name__}: {e}") from e
        if resp.status != 200:
            text = data.decode(errors="replace")[:300]
            raise ApiError(f"HTTP {resp.status}: {text}", resp.status, _seconds(resp.getheader("retry-after")))
        try:
            completion = json.loads(data)
            usage = completion.get("usage") or {}
            prompt = int(usage.get("prompt_tokens") or 0)
            return Reply(completion["choices"][0]["message"], prompt, prompt + int(usage.get("completion_tokens") or 0))
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            raise ApiError(f"malformed chat completion ({type(e).__name__}): {data[:200]!r}", resp.status) from e

    def complete(self, request: dict[str, Any], headers: dict[str, str] | None = None) -> Reply:
        body = json.dumps(request).encode()
        for attempt in range(self.max_retries + 1):
            try:
                return self._post_once(body, headers or {})
            except ApiError as e:
                if attempt == self.max_retries or (e.status is not None and e.status not in RETRYABLE):
                    raise
                delay = e.retry_after if e.retry_after is not None else 0.5 * 2**attempt
                time.sleep(min(delay, 30.0))
        raise AssertionError("unreachable")


def rollout_tool_factor(rollout_id: str, sigma: float) -> float:
    """This rollout's tool-time factor: lognormal with mean 1, the same for the same rollout id."""
    return random.Random(rollout_id).lognormvariate(-sigma * sigma / 2, sigma) if sigma > 0 else 1.0


def write_result(path: Path, result: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


class Thread:
    """One conversation of the rollout: the main agent's, or a sub-agent's (its calls carry `X-Agent-Id`)."""

    def __init__(self, prompt: str, visible_checks: list[dict], max_turns: int, agent_id: str = "") -> None:
        self.prompt = prompt
        self.visible_checks = visible_checks
        self.max_turns = max_turns
        self.headers = {AGENT_ID_HEADER: agent_id} if agent_id else {}
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": prompt},
        ]
        self.turns = 0  # since the thread started or last compacted
        self.compacted = False
        self.tokens = 0  # the thread's length at its last reply (usage: prompt + completion)
        self.chars_since = 0  # characters of the messages added since (tool results, sub-agents' results)

    def add(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        self.chars_since += len(str(message.get("content") or ""))

    def estimated_tokens(self) -> int:
        """Its length now: the last reply's usage, plus what came since at CHARS_PER_TOKEN (as harnesses estimate)."""
        return self.tokens + self.chars_since // CHARS_PER_TOKEN


class Agent:
    """The agent loop over threads, with what real harnesses do besides: it compacts a thread whose context
    nears its window (a summary call, then the thread goes on from the summary), hands a task's delegable
    sub-tasks to sub-agents, and re-sends a request whose reply has no usable tool call."""

    def __init__(self, args: argparse.Namespace, client: ChatClient, workspace: Path, result: dict[str, Any]) -> None:
        self.args = args
        self.client = client
        self.workspace = workspace
        self.result = result
        self.errors: list[str] = []
        self.tool_time = args.tool_time * rollout_tool_factor(args.rollout_id, args.tool_time_sigma)
        self.start = time.monotonic()

    def request(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        return {"model": self.args.model, "messages": messages, "tools": TOOL_SCHEMAS,
                "max_tokens": self.args.max_tokens, "temperature": self.args.temperature}  # fmt: skip

    def ask(self, thread: Thread) -> Reply:
        """The thread's next reply; one without a usable tool call is dropped and the identical request sent
        again, up to --reply-retries times (the dropped reply stays in the trajectory tree as a dead branch)."""
        request = self.request(thread.messages)
        for _ in range(self.args.reply_retries):
            reply = self.client.complete(request, thread.headers)
            if usable_tool_calls(reply.message):
                return reply
            self.result["retries"] += 1
        return self.client.complete(request, thread.headers)

    def compact(self, thread: Thread) -> None:
        """Replace the thread's turns by a summary the policy writes (Claude Code's compaction: the same system
        prompt and tools, the conversation so far, then the summary request). The thread goes on from the
        summary, the task and its last turn, kept as it was (the agent's latest action and what it saw)."""
        request = self.request([*thread.messages, {"role": "user", "content": SUMMARY_PROMPT}])
        reply = self.client.complete(request, thread.headers)
        self.result["summaries"] += 1
        last = max(i for i, m in enumerate(thread.messages) if m["role"] == "assistant")
        thread.messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"{CONTINUED_PREFIX}\n{summary_text(reply.message)}"},
            {"role": "user", "content": thread.prompt},
            *thread.messages[last:],
        ]
        thread.turns, thread.compacted = 0, True
        thread.tokens, thread.chars_since = reply.tokens, 0  # the summary call's length: more than the thread's

    def run_thread(self, thread: Thread, after_first_turn: Callable[[], None] | None = None) -> str:
        """The thread's turns until it finishes, stops calling tools or runs out of turns; its stop reason.
        `after_first_turn` runs once the first turn is done (the main agent's delegation). Raises ApiError
        when a call fails for good."""
        for turn in range(thread.max_turns):
            if self.needs_compaction(thread):
                self.compact(thread)
            reply = self.ask(thread)
            self.result["turns"] += 1
            thread.turns += 1
            thread.tokens, thread.chars_since = reply.tokens, 0
            stop = self.act(thread, reply.message)
            self.report()
            if turn == 0 and after_first_turn is not None:
                after_first_turn()
            if stop:
                return stop
        return "max_turns"

    def needs_compaction(self, thread: Thread) -> bool:
        """Before a request: the thread has reached --compact-tokens, one turn after it started or two after it
        last compacted (on a small window a compacted thread starts near the limit: it would compact after
        every turn)."""
        limit = self.args.compact_tokens
        turns = thread.turns >= (2 if thread.compacted else 1)
        return bool(limit) and turns and thread.estimated_tokens() >= limit

    def report(self) -> None:
        """Rewrite the result file (after every turn: a killed run still reports its turns)."""
        self.result.update(errors=self.errors[-20:], wall_s=round(time.monotonic() - self.start, 3))
        write_result(self.args.result_file, self.result)

    def act(self, thread: Thread, message: dict[str, Any]) -> str:
        """Run the reply's tool calls; "finish" or "no_tool_call" when the thread ends, else ""."""
        calls = message.get("tool_calls") or []
        thread.add({"role": "assistant", "content": message.get("content"), **({"tool_calls": calls} if calls else {})})
        if not calls:
            return "no_tool_call"
        for call in calls:
            fn = call.get("function") or {}
            time.sleep(self.tool_time)
            outcome = execute_tool(
                self.workspace, fn.get("name", ""), fn.get("arguments"), thread.visible_checks, self.args.tool_delay
            )
            self.result["tool_calls"] += 1
            if outcome.finished:
                return "finish"
            if outcome.error:
                self.errors.append(outcome.text)
            thread.add({"role": "tool", "tool_call_id": call.get("id", ""), "content": outcome.text})
        return ""

    def delegate(self, subtasks: list[dict[str, Any]], main: Thread) -> None:
        """Each sub-task to a sub-agent of its own, one after another; what each did comes back into the main
        agent's context after its first turn (as a sub-agent's result does in Claude Code's)."""
        reports = []
        for i, sub in enumerate(subtasks):
            agent_id = f"a{random.Random(f'{self.args.rollout_id}/{i}').getrandbits(64):016x}"
            thread = Thread(sub["prompt"], sub["visible_checks"], min(self.args.max_turns, sub["max_turns"]), agent_id)
            stop = self.run_thread(thread)
            self.result["subagents"].append({"agent_id": agent_id, "stop_reason": stop})
            reports.append(last_tool_result(thread.messages) or stop)
        if reports:
            main.add({"role": "user", "content": f"{SUBAGENTS_PREFIX} {'; '.join(reports)}."})


def usable_tool_calls(message: dict[str, Any]) -> bool:
    """A reply the agent can act on: at least one call of a known tool with JSON-object arguments."""
    calls = message.get("tool_calls") or []
    for call in calls:
        fn = call.get("function") or {}
        if fn.get("name") not in TOOL_NAMES:
            return False
        try:
            parse_arguments(fn.get("arguments"))
        except ToolError:
            return False
    return bool(calls)


def last_tool_result(messages: list[dict[str, Any]]) -> str:
    return next((str(m["content"]) for m in reversed(messages) if m["role"] == "tool"), "")


def summary_text(message: dict[str, Any]) -> str:
    """What the summary reply said: its text, else its tool calls as written (a small policy may answer so)."""
    if message.get("content"):
        return str(message["content"])
    calls = [c.get("function") or {} for c in message.get("tool_calls") or []]
    return "\n".join(f"{fn.get('name', '')}({fn.get('arguments') or ''})" for fn in calls) or "(empty)"


def run(args: argparse.Namespace) -> dict[str, Any]:
    task = json.loads(Path(args.task_file).read_text())
    args.result_file = Path(args.result_file)
    client = ChatClient(args.base_url, args.rollout_id, args.request_timeout, args.max_retries)
    result: dict[str, Any] = {"rollout_id": args.rollout_id, "turns": 0, "tool_calls": 0, "stop_reason": "running",
                              "summaries": 0, "retries": 0, "subagents": []}  # fmt: skip
    agent = Agent(args, client, Path(args.workspace), result)
    plan = task.get("delegation") if args.subagents else None
    main = Thread(plan["prompt"], plan["visible_checks"], args.max_turns) if plan else (
        Thread(task["prompt"], task["visible_checks"], args.max_turns))  # fmt: skip
    subtasks = plan["subtasks"] if plan else []
    try:  # the main agent's first turn, then its sub-agents, then the rest of its turns
        result["stop_reason"] = agent.run_thread(main, (lambda: agent.delegate(subtasks, main)) if subtasks else None)
    except ApiError as e:  # a 400 (e.g. context too long) ends the episode; the rest is infrastructure
        agent.errors.append(str(e))
        result["stop_reason"] = "bad_request" if e.status == 400 else "api_error"
    agent.report()
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Gyre's built-in tool-using agent harness (OpenAI Chat Completions).")
    p.add_argument("--base-url", required=True, help="OpenAI base URL including /v1")
    p.add_argument("--workspace", required=True)
    p.add_argument("--task-file", required=True, help="JSON with prompt and visible_checks")
    p.add_argument("--result-file", required=True)
    p.add_argument("--rollout-id", default="")
    p.add_argument("--model", default="policy")
    p.add_argument("--max-turns", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--tool-delay", type=float, default=0.0, help="seconds run_checks sleeps (emulates slow tools)")
    p.add_argument("--tool-time", type=float, default=0.0, help="mean seconds every tool call takes (slow tools)")
    p.add_argument("--tool-time-sigma", type=float, default=1.0, help="lognormal spread of --tool-time per rollout")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--max-retries", type=int, default=3)
    p.add_argument("--reply-retries", type=int, default=0, help="re-send a request whose reply has no usable tool call")
    p.add_argument(
        "--compact-tokens", type=int, default=0, help="compact a thread this long (prompt + reply); 0: never"
    )
    p.add_argument("--subagents", action="store_true", help="hand a task's delegable sub-tasks to sub-agents")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    result = run(parse_args(argv))
    return 1 if result["stop_reason"] == "api_error" else 0


if __name__ == "__main__":
    sys.exit(main())
