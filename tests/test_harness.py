"""The built-in harness as a real process against a scripted OpenAI-compatible server (aiohttp).

The server replays a fixed script of replies (a task's demonstration, stalls, HTTP errors): this
tests the harness program and the runner that supervises it, not a model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gyre.config.schema import HarnessConfig, TaskConfig
from gyre.harness.demos import demonstration
from gyre.harness.runner import live_group_members, run_rollout, run_rollouts
from gyre.harness.tools import TOOL_SCHEMAS, execute_tool
from gyre.sandbox.base import WORKSPACE
from gyre.tasks.families import FAMILIES, echo_files_task, fix_value_task, write_value_task
from gyre.tasks.suite import sample_tasks

STALL = "stall"


def tool_reply(name: str, i: int, **arguments: Any) -> dict[str, Any]:
    call = {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


class ScriptedServer:
    """Answers each rollout's requests, in order, from its script: an assistant message, an HTTP
    status (error), or STALL (never answers)."""

    def __init__(self, scripts: dict[str, list[Any]]) -> None:
        self.scripts = {rid: list(script) for rid, script in scripts.items()}
        self.requests: dict[str, list[dict[str, Any]]] = {rid: [] for rid in scripts}
        self.headers: list[dict[str, str]] = []
        self.closing = asyncio.Event()

    async def chat(self, request: web.Request) -> web.Response:
        rid = request.headers.get("X-Rollout-Id", "")
        self.headers.append(dict(request.headers))
        self.requests[rid].append(await request.json())
        step = self.scripts[rid].pop(0)
        if step == STALL:
            await self.closing.wait()
            return web.json_response({"error": "shutting down"}, status=503)
        if isinstance(step, int):
            return web.json_response(
                {"error": {"message": f"scripted {step}"}}, status=step, headers={"Retry-After": "0"}
            )
        choice = {"index": 0, "message": step, "finish_reason": "tool_calls" if step.get("tool_calls") else "stop"}
        return web.json_response({"id": "x", "object": "chat.completion", "choices": [choice]})

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        return f"http://{host}:{port}"  # the proxy root; the runner appends /v1

    async def __aexit__(self, *exc: object) -> None:
        self.closing.set()
        await self.runner.cleanup()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


HARNESS = HarnessConfig(timeout_s=20.0, max_turns=10, max_tokens=64, temperature=0.7)


@pytest.mark.integration
def test_harness_replays_demonstrations_to_full_score(tmp_path):
    tasks = [sample_tasks([family], 1, seed=5)[0] for family in sorted(FAMILIES)]
    demos = {f"r{i}": demonstration(task).messages for i, task in enumerate(tasks)}
    scripts = {rid: [m for m in messages if m["role"] == "assistant"] for rid, messages in demos.items()}

    server = ScriptedServer(scripts)

    async def main() -> list:
        async with server as url:
            jobs = [(task, f"r{i}") for i, task in enumerate(tasks)]
            return await run_rollouts(jobs, url, tmp_path, HARNESS, TaskConfig())

    outcomes = run(main())
    for outcome in outcomes:
        rid = outcome.rollout_id
        assert (outcome.grade.status, outcome.grade.score, outcome.stop_reason) == ("ok", 1.0, "finish"), outcome
        assert outcome.turns == len(scripts[rid]) and not outcome.timed_out and not outcome.errors
        for request in server.requests[rid]:  # the harness sent exactly the demonstration's prefix
            assert request["messages"] == demos[rid][: len(request["messages"])]
            assert request["tools"] == TOOL_SCHEMAS
            assert (request["max_tokens"], request["temperature"]) == (64, 0.7)
    assert {h["X-Rollout-Id"] for h in server.headers} == set(scripts)


@pytest.mark.integration
def test_stalled_server_kills_harness_group_and_grades_workspace(tmp_path):
    task = echo_files_task({"a.txt": "red", "b.txt": "cat", "c.txt": "sun"})
    script = [tool_reply("write_file", 0, path="a.txt", content="red"),
              tool_reply("write_file", 1, path="b.txt", content="cat"), STALL]  # fmt: skip

    async def main() -> Any:
        async with ScriptedServer({"r": script}) as url:
            return await run_rollout(task, "r", url, tmp_path / "r", HarnessConfig(timeout_s=2.0), TaskConfig())

    start = time.monotonic()
    outcome = run(main())
    assert time.monotonic() - start < 8.0
    assert outcome.timed_out and outcome.stop_reason == "timeout" and outcome.turns == 2
    assert outcome.grade.status == "timeout" and outcome.grade.score == pytest.approx(2 / 3)
    assert live_group_members(outcome.pid) == []


@pytest.mark.integration
def test_hung_tool_subprocess_dies_with_the_harness(tmp_path):
    """run_checks runs the agent's config.py, which sleeps: the harness and that child are killed (the
    sandbox shows the workspace at /workspace; the host's /proc sees the child under that path)."""
    task = fix_value_task("config.py", {"LIMIT": 3, "DEBUG": False}, "LIMIT", 8)
    script = [tool_reply("write_file", 0, path="config.py", content="import time\ntime.sleep(120)\nLIMIT = 8\n"),
              tool_reply("run_checks", 1), STALL]  # fmt: skip
    children: set[int] = set()

    async def watch() -> None:
        while True:
            for pid in os.listdir("/proc"):
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if pid.isdigit() and f"{WORKSPACE}/config.py".encode() in cmdline:
                    children.add(int(pid))
            await asyncio.sleep(0.05)

    async def main() -> Any:
        async with ScriptedServer({"r": script}) as url:
            watcher = asyncio.create_task(watch())
            try:
                cfg = TaskConfig(check_timeout_s=1.5)
                return await run_rollout(task, "r", url, tmp_path / "r", HarnessConfig(timeout_s=2.0), cfg)
            finally:
                watcher.cancel()

    outcome = run(main())
    assert outcome.timed_out and outcome.grade.status == "timeout" and outcome.grade.score == 0.0
    assert children, "the visible check never started the agent's script"
    assert live_group_members(outcome.pid) == []
    for pid in children:
        state = (
            Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if Path(f"/proc/{pid}").exists()
            else "gone"
        )
        assert state in ("gone", "Z"), f"child {pid} survived in state {state}"


@pytest.mark.integration
def test_paths_escaping_the_workspace_are_rejected(tmp_path):
    task = dataclasses.replace(write_value_task("answer.txt", "apple"), max_turns=10)
    outside = tmp_path / "outside.txt"
    script = [tool_reply("write_file", 0, path="../../outside.txt", content="x"),
              tool_reply("write_file", 1, path=str(outside), content="x"),
              tool_reply("read_file", 2, path="../task.json"),
              tool_reply("write_file", 3, path="answer.txt", content="apple"),
              tool_reply("finish", 4)]  # fmt: skip
    server = ScriptedServer({"r": script})

    async def main() -> Any:
        async with server as url:
            return await run_rollout(task, "r", url, tmp_path / "r", HARNESS, TaskConfig())

    outcome = run(main())
    assert not outcome.timed_out and outcome.stop_reason == "finish" and outcome.grade.score == 1.0
    assert not outside.exists() and not (tmp_path / "r" / "outside.txt").exists()
    tool_texts = [m["content"] for m in server.requests["r"][-1]["messages"] if m["role"] == "tool"]
    assert [t.startswith("error: path") for t in tool_texts] == [True, True, True, False]
    assert len(outcome.errors) == 3


@pytest.mark.integration
def test_retries_then_stops_on_bad_request(tmp_path):
    task = write_value_task("answer.txt", "apple")
    script = [503, 429, tool_reply("write_file", 0, path="answer.txt", content="apple"), 400]
    server = ScriptedServer({"r": script})

    async def main() -> Any:
        async with server as url:
            return await run_rollout(task, "r", url, tmp_path / "r", HARNESS, TaskConfig())

    outcome = run(main())
    assert len(server.requests["r"]) == 4 and outcome.turns == 1
    assert outcome.stop_reason == "bad_request" and "HTTP 400" in outcome.errors[-1]
    assert (outcome.grade.status, outcome.grade.score) == ("ok", 1.0)  # the agent's work still counts


@pytest.mark.integration
def test_unreachable_model_is_excluded_not_zero(tmp_path):
    task = write_value_task("answer.txt", "apple")

    async def main() -> Any:
        async with ScriptedServer({"r": [500] * 10}) as url:
            return await run_rollout(task, "r", url, tmp_path / "r", HARNESS, TaskConfig())

    outcome = run(main())
    assert outcome.stop_reason == "api_error"
    assert (outcome.grade.status, outcome.grade.score) == ("failed", None) and "HTTP 500" in outcome.grade.reason


@pytest.mark.integration
def test_reply_without_tool_call_ends_the_episode(tmp_path):
    task = write_value_task("answer.txt", "apple")
    script = [{"role": "assistant", "content": "I am done."}]

    async def main() -> Any:
        async with ScriptedServer({"r": script}) as url:
            return await run_rollout(task, "r", url, tmp_path / "r", HARNESS, TaskConfig())

    outcome = run(main())
    assert (outcome.stop_reason, outcome.turns, outcome.grade.status, outcome.grade.score) == (
        "no_tool_call",
        1,
        "ok",
        0.0,
    )


@pytest.mark.integration
def test_max_turns_from_the_task_hint(tmp_path):
    task = write_value_task("answer.txt", "apple")  # hint: 2 solution turns + 2
    script = [tool_reply("list_files", i) for i in range(10)]

    async def main() -> Any:
        async with ScriptedServer({"r": script}) as url:
            return await run_rollout(task, "r", url, tmp_path / "r", HARNESS, TaskConfig())

    outcome = run(main())
    assert (outcome.stop_reason, outcome.turns, outcome.grade.score) == ("max_turns", task.max_turns, 0.0)


@pytest.mark.unit
def test_tool_execution_stays_inside_the_workspace(tmp_path):
    workspace, outside = tmp_path / "ws", tmp_path / "outside"
    workspace.mkdir()
    outside.mkdir()
    (workspace / "link").symlink_to(outside)
    for path in ["../x", "/etc/hostname", "link/x", "a/../../x", ".", ""]:
        result = execute_tool(workspace, "write_file", {"path": path, "content": "x"}, [])
        assert result.error and result.text.startswith("error: path"), (path, result)
    assert list(outside.iterdir()) == [] and not (tmp_path / "x").exists()
    assert execute_tool(workspace, "write_file", {"path": "d/e.txt", "content": "hi"}, []).text == "wrote d/e.txt"
    assert execute_tool(workspace, "read_file", '{"path": "d/e.txt"}', []).text == "hi"
    assert execute_tool(workspace, "list_files", "{}", []).text == "d/e.txt"
    assert execute_tool(workspace, "read_file", "{not json", []).text.startswith("error: arguments are not valid JSON")
    assert execute_tool(workspace, "rm", {}, []).text.startswith("error: unknown tool rm")
    assert execute_tool(workspace, "finish", "{}", []).finished
    checks = [{"name": "d/e.txt exists", "kind": "file_exists", "path": "d/e.txt"}]
    start = time.monotonic()
    assert execute_tool(workspace, "run_checks", {}, checks, tool_delay=0.2).text == "d/e.txt exists: ok"
    assert time.monotonic() - start >= 0.2


@pytest.mark.unit
def test_harness_imports_only_the_standard_library():
    code = "import sys, gyre.harness.builtin; print(sorted({m.split('.')[0] for m in sys.modules}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert not {"torch", "numpy", "aiohttp", "openai", "tokenizers"} & set(json.loads(out.replace("'", '"')))
