"""Record the requests the pinned Claude Code CLI, mini-swe-agent and Codex CLI send (gyre/harness/templates/*.json).

The CLI runs once per mode (`--bare` and full) on a placeholder task against a loopback capture server
that answers each request as the Messages API would (one Bash tool_use, then end_turn), and the
request bodies it sent are saved with the parts that vary per run as placeholders: {prompt} (the
task prompt), {home}, {cwd} (the workspace), {date}. gyre/harness/formats.py renders a task's first request
and demonstration from them; the real proxy checks the rendering token for token
(tests/test_harness_presets.py), so a CLI update that changes its requests fails there until this is
re-run:

    python -m tools.record_harness_templates
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

from gyre.harness.claude_code import claude_args, claude_bin, claude_env, user_lines
from gyre.harness.codex import HOME_DIR
from gyre.harness.formats import TEMPLATE_DIR, placeholders
from gyre.harness.mini_swe_agent import venv_python
from gyre.proxy.responses_api import sse_events

PROMPT = 'Create "gyre_probe.txt" containing "gyreprobe".'
COMMAND = "printf %s gyreprobe > gyre_probe.txt"
CODEX_SESSION_FIELDS = ("prompt_cache_key", "client_metadata")  # a new session id each run


def _reply(body: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    last = body["messages"][-1]["content"]
    answered = isinstance(last, list) and any(b.get("type") == "tool_result" for b in last)
    if answered:
        return [{"type": "text", "text": "Done."}], "end_turn"
    return [{"type": "tool_use", "id": "toolu_1_0", "name": "Bash", "input": {"command": COMMAND}}], "tool_use"


def _sse(content: list[dict[str, Any]], stop: str) -> bytes:
    use = {"input_tokens": 1, "output_tokens": 1}
    msg = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [], "stop_reason": None,
           "stop_sequence": None, "usage": use}  # fmt: skip
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start", "message": msg})]
    for i, block in enumerate(content):
        if block["type"] == "text":
            opened, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            opened = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events.append(("content_block_start", {"type": "content_block_start", "index": i, "content_block": opened}))
        events.append(("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    events.append(("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop}, "usage": use}))
    events.append(("message_stop", {"type": "message_stop"}))
    return "".join(f"event: {e}\ndata: {json.dumps(d)}\n\n" for e, d in events).encode()


def capture(bare: bool, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """The request bodies of one CLI session on PROMPT, in order."""
    bodies: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
            bodies.append(body)
            content, stop = _reply(body)
            if body.get("stream"):
                data, kind = _sse(content, stop), "text/event-stream"
            else:
                data = json.dumps({"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                                   "content": content, "stop_reason": stop, "stop_sequence": None,
                                   "usage": {"input_tokens": 1, "output_tokens": 1}}).encode()  # fmt: skip
                kind = "application/json"
            _send(self, data, kind)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ws, home = Path(tmp) / "workspace", Path(tmp) / "home"
            ws.mkdir()
            home.mkdir()
            env = claude_env(f"http://127.0.0.1:{server.server_port}", "rec", home)
            cmd = [str(claude_bin()), *claude_args(4, bare=bare)]
            proc = subprocess.run(cmd, cwd=ws, env=env, input=user_lines([PROMPT]), capture_output=True, text=True,
                                  timeout=timeout_s)  # fmt: skip
            if (ws / "gyre_probe.txt").read_text() != "gyreprobe":
                raise RuntimeError(f"the CLI did not run the tool call: {proc.stdout[-2000:]}")
            return [placeholders(b, PROMPT, str(ws), str(home), time.strftime("%Y-%m-%d")) for b in bodies]
    finally:
        server.shutdown()


def _send(handler: BaseHTTPRequestHandler, data: bytes, kind: str) -> None:
    """A 200 answer of `data` from either recording server."""
    handler.send_response(200)
    handler.send_header("content-type", kind)
    handler.send_header("content-length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


MINI_REPLIES = [
    f"THOUGHT: I will write the file.\n\n```mswea_bash_command\n{COMMAND}\n```",
    "THOUGHT: The file is written.\n\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```",
]


def capture_mini(bare: bool, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """The chat completion requests of one mini-swe-agent run (gyre.harness.mini_swe_agent, no sandbox;
    `bare`: its compact templates)."""
    bodies: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
            bodies.append(body)
            text = MINI_REPLIES[min(len(bodies), len(MINI_REPLIES)) - 1]
            data = json.dumps({
                "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body.get("model", "m"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }).encode()  # fmt: skip
            _send(self, data, "application/json")

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ws, io = Path(tmp) / "workspace", Path(tmp) / "io"
            ws.mkdir()
            io.mkdir()
            (io / "task.json").write_text(json.dumps({"prompt": PROMPT}))
            cmd = [venv_python(), "-m", "gyre.harness.mini_swe_agent", "--base-url", f"http://127.0.0.1:{server.server_port}/v1",
                   "--rollout-id", "rec", "--workspace", str(ws), "--task-file", str(io / "task.json"),
                   "--result-file", str(io / "result.json"), "--max-turns", "4", *(["--bare"] if bare else [])]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
            if (ws / "gyre_probe.txt").read_text() != "gyreprobe":
                raise RuntimeError(f"mini-swe-agent did not run the command: {proc.stderr[-2000:]}")
            return [placeholders(b, PROMPT, str(ws), str(io), time.strftime("%Y-%m-%d")) for b in bodies]
    finally:
        server.shutdown()


def _codex_reply(body: dict[str, Any]) -> list[dict[str, Any]]:
    """One exec_command call running COMMAND, then (its output sent back) a short message."""
    if any(item.get("type") == "function_call_output" for item in body["input"]):
        text = {"type": "output_text", "text": "Done.", "annotations": [], "logprobs": []}
        return [{"id": "msg_1", "type": "message", "role": "assistant", "status": "completed", "content": [text]}]
    return [{"id": "fc_1", "type": "function_call", "status": "completed", "call_id": "call_1_0",
             "name": "exec_command", "arguments": json.dumps({"cmd": COMMAND})}]  # fmt: skip


def _codex_sse(items: list[dict[str, Any]]) -> bytes:
    use = {"input_tokens": 1, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 1,
           "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 2}  # fmt: skip
    done = {"id": "resp_1", "object": "response", "created_at": 0, "status": "completed", "model": "m",
            "output": items, "usage": use}  # fmt: skip
    events = sse_events({**done, "status": "in_progress", "output": [], "usage": None}, done)
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()


def capture_codex(bare: bool, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """The Responses API requests of one Codex session (gyre.harness.codex, no sandbox), run-specific
    fields (the session's cache key and client metadata) dropped."""
    bodies: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
            bodies.append(body)
            _send(self, _codex_sse(_codex_reply(body)), "text/event-stream")

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ws, io = Path(tmp) / "workspace", Path(tmp) / "io"
            ws.mkdir()
            io.mkdir()
            (io / "task.json").write_text(json.dumps({"prompt": PROMPT}))
            cmd = [sys.executable, "-m", "gyre.harness.codex", "--base-url", f"http://127.0.0.1:{server.server_port}/v1",
                   "--rollout-id", "rec", "--workspace", str(ws), "--task-file", str(io / "task.json"),
                   "--result-file", str(io / "result.json"), "--max-turns", "4", *(["--bare"] if bare else [])]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
            if (ws / "gyre_probe.txt").read_text() != "gyreprobe":
                raise RuntimeError(f"Codex did not run the command: {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
            home = io / HOME_DIR
            kept = [_codex_stable(b) for b in bodies]
            return [placeholders(b, PROMPT, str(ws), str(home), time.strftime("%Y-%m-%d")) for b in kept]
    finally:
        server.shutdown()


def _codex_stable(body: dict[str, Any]) -> dict[str, Any]:
    """A request without what changes with every session: its cache key, client metadata and item ids."""
    kept = {k: v for k, v in body.items() if k not in CODEX_SESSION_FIELDS}
    kept["input"] = [{k: v for k, v in item.items() if k != "id"} for item in body["input"]]
    return kept


def record_codex(out: Path) -> None:
    for bare in (True, False):
        bodies = capture_codex(bare)
        template = {"first": bodies[0], "after_command": bodies[1], "command": COMMAND}
        path = out / ("codex_bare.json" if bare else "codex.json")
        path.write_text(json.dumps(template, indent=1) + "\n")
        print(f"{path}: {len(bodies)} requests, tools {[t['name'] for t in bodies[0]['tools']]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=TEMPLATE_DIR)
    p.add_argument("--only", choices=("claude_code", "mini_swe_agent", "codex"), default=None)
    args = p.parse_args()
    if args.only in (None, "codex"):
        record_codex(args.out)
    if args.only == "codex":
        return
    for bare in (True, False) if args.only != "mini_swe_agent" else ():
        bodies = capture(bare)
        first = next(b for b in bodies if b.get("tools"))  # the main thread's first request
        last = next(b for b in reversed(bodies) if b.get("tools") and len(b["messages"]) > len(first["messages"]))
        template = {"first": first, "after_tool": last, "command": COMMAND}
        path = args.out / ("claude_code_bare.json" if bare else "claude_code.json")
        path.write_text(json.dumps(template, indent=1) + "\n")  # key order as sent: tools render in it
        print(f"{path}: {len(bodies)} requests, tools {[t['name'] for t in first['tools']]}")
    if args.only == "claude_code":
        return
    for bare in (False, True):
        bodies = capture_mini(bare)
        template = {"first": bodies[0], "after_command": bodies[1], "replies": MINI_REPLIES, "command": COMMAND}
        path = args.out / ("mini_swe_agent_bare.json" if bare else "mini_swe_agent.json")
        path.write_text(json.dumps(template, indent=1) + "\n")
        print(f"{path}: {len(bodies)} requests")


if __name__ == "__main__":
    main()
