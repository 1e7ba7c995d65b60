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
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gyre.config.schema import HarnessConfig, TaskConfig
from gyre.harness import runner
from gyre.harness.builtin import CONTINUED_PREFIX, SUBAGENTS_PREFIX, SUMMARY_PROMPT
from gyre.harness.demos import demonstration
from gyre.harness.endpoint import ProxyEndpoint
from gyre.harness.runner import live_group_members, run_rollout, run_rollouts
from gyre.harness.tools import TOOL_SCHEMAS, execute_tool
from gyre.proxy.keys import RolloutKeys
from gyre.proxy.roles import chat_call_role
from gyre.sandbox.base import WORKSPACE
from gyre.tasks.families import FAMILIES, echo_files_task, fix_value_task, write_value_task
from gyre.tasks.suite import sample_tasks

STALL = "stall"
TOKENS_PER_MESSAGE, REPLY_TOKENS = 40, 10  # the scripted server's usage: 40 tokens a message, 10 a reply


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
        messages = self.requests[rid][-1]["messages"]
        usage = {"prompt_tokens": TOKENS_PER_MESSAGE * len(messages), "completion_tokens": REPLY_TOKENS}
        return web.json_response({"id": "x", "object": "chat.completion", "choices": [choice], "usage": usage})

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
def test_the_runner_says_the_harness_ended_before_it_grades(tmp_path, monkeypatch):
    """on_harness_end comes once the harness's processes are gone and its result written, before grading
    (the session driver gives the rollout's slot to the next one then)."""
    task = write_value_task("a.txt", "x")
    script = [m for m in demonstration(task).messages if m["role"] == "assistant"]
    seen: list[tuple[str, object]] = []
    grade = runner.grade_workspace

    def graded(*args, **kwargs):  # the real grader, noted when it starts
        seen.append(("grade", None))
        return grade(*args, **kwargs)

    def ended() -> None:
        harness = [p for p in Path("/proc").glob("[0-9]*/cmdline") if str(tmp_path).encode() in _read(p)]
        seen.append(("harness ended", ((tmp_path / "r" / "harness" / "result.json").exists(), harness)))

    monkeypatch.setattr(runner, "grade_workspace", graded)

    async def main() -> Any:
        async with ScriptedServer({"r": script}) as url:
            return await run_rollout(task, "r", url, tmp_path / "r", HARNESS, TaskConfig(), on_harness_end=ended)

    outcome = run(main())
    assert (outcome.grade.status, outcome.grade.score) == ("ok", 1.0)
    assert seen == [("harness ended", (True, [])), ("grade", None)]


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


@pytest.mark.integration
def test_a_rollout_cancelled_while_its_endpoint_starts_leaves_no_socket_directory_and_no_key(tmp_path, monkeypatch):
    """A run stopped while sessions start (a requeue, a preemption, a failed cell) cancels them where they
    are, here in starting the rollout's proxy endpoint: its socket directory is removed and its key revoked
    all the same (they were left in TMPDIR and live before)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    start = ProxyEndpoint._start

    async def slow_start(self: ProxyEndpoint) -> None:
        await asyncio.sleep(30)
        await start(self)

    monkeypatch.setattr(ProxyEndpoint, "_start", slow_start)
    keys = RolloutKeys()
    task = write_value_task("a.txt", "x")

    async def main() -> None:
        rollout = asyncio.create_task(
            run_rollout(task, "r", "http://127.0.0.1:9", tmp_path / "r", HARNESS, TaskConfig(), keys=keys)
        )
        while not list(tmp.glob("gyre-ep-*")):
            await asyncio.sleep(0.01)
        assert keys.live() == 1
        rollout.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rollout

    run(main())
    assert list(tmp.iterdir()) == [] and keys.live() == 0


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
    """It starts without site-packages (-S, as harness_argv runs it: no .pth files at each rollout's start)."""
    code = "import sys, gyre.harness.builtin; print(sorted({m.split('.')[0] for m in sys.modules}))"
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert not {"torch", "numpy", "aiohttp", "openai", "tokenizers"} & set(json.loads(out.replace("'", '"')))


def text_reply(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def roles_seen(server: ScriptedServer, rid: str) -> list[str]:
    """Each request's role as the proxy labels it (gyre/proxy/roles.py), from its headers and messages."""
    mine = [h for h in server.headers if h.get("X-Rollout-Id") == rid]
    return [
        chat_call_role(h, r["messages"], bool(r.get("tools"))) for h, r in zip(mine, server.requests[rid], strict=True)
    ]


def rollout(task: Any, script: list[Any], tmp_path: Path, **harness: Any) -> tuple[Any, ScriptedServer]:
    server = ScriptedServer({"r": script})

    async def main() -> Any:
        async with server as url:
            cfg = dataclasses.replace(HARNESS, **harness)
            return await run_rollout(task, "r", url, tmp_path / "r", cfg, TaskConfig())

    return run(main()), server


@pytest.mark.integration
def test_a_long_thread_is_compacted_by_a_summary_call_and_goes_on_from_its_last_turn(tmp_path):
    """40 tokens a message: after the second write the thread is 4 x 40 + 10 = 170 tokens (>= 150, and 90
    more than its first request's 80): the harness asks for a summary, then goes on from it."""
    task = echo_files_task({"a.txt": "red", "b.txt": "cat", "c.txt": "sun"})
    script = [tool_reply("write_file", 0, path="a.txt", content="red"),
              tool_reply("write_file", 1, path="b.txt", content="cat"),
              text_reply("I wrote a.txt and b.txt."),
              tool_reply("write_file", 2, path="c.txt", content="sun"),
              tool_reply("finish", 3)]  # fmt: skip
    outcome, server = rollout(task, script, tmp_path, compact_tokens=150)
    assert (outcome.stop_reason, outcome.grade.score, outcome.turns) == ("finish", 1.0, 4)
    assert roles_seen(server, "r") == ["main", "main", "main_summary", "main", "main"]
    requests = server.requests["r"]
    assert requests[2]["messages"] == [*requests[1]["messages"], script[1], ANY_TOOL, USER(SUMMARY_PROMPT)]
    system, task_prompt = requests[0]["messages"]
    assert requests[3]["messages"] == [
        system, USER(f"{CONTINUED_PREFIX}\nI wrote a.txt and b.txt."), task_prompt, script[1], ANY_TOOL
    ]  # fmt: skip
    assert requests[2]["tools"] == requests[1]["tools"] == TOOL_SCHEMAS  # a summary call is the thread's own


@pytest.mark.integration
def test_a_thread_under_the_limit_or_not_grown_since_compaction_is_not_compacted(tmp_path):
    task = write_value_task("answer.txt", "apple")
    script = [tool_reply("write_file", 0, path="answer.txt", content="apple"), tool_reply("finish", 1)]
    outcome, server = rollout(task, script, tmp_path, compact_tokens=500)
    assert outcome.stop_reason == "finish" and roles_seen(server, "r") == ["main", "main"]


@pytest.mark.integration
def test_delegated_sub_tasks_run_in_sub_agents_after_the_main_agents_first_turn(tmp_path):
    """echo_files of three files: a write_value prompt per file, the 1st the main agent's; after its first turn
    the 2nd and 3rd go to sub-agents (their calls carry X-Agent-Id: the proxy labels them subagent), whose
    results come back into the main agent's context before its next turn."""
    task = echo_files_task({"a.txt": "red", "b.txt": "cat", "c.txt": "sun"})
    script = [tool_reply("write_file", 0, path="a.txt", content="red"),
              tool_reply("write_file", 0, path="b.txt", content="cat"), tool_reply("finish", 1),
              tool_reply("write_file", 0, path="c.txt", content="sun"), tool_reply("finish", 1),
              tool_reply("finish", 1)]  # fmt: skip
    outcome, server = rollout(task, script, tmp_path, subagents=True)
    assert (outcome.stop_reason, outcome.grade.score, outcome.turns) == ("finish", 1.0, 6)
    assert roles_seen(server, "r") == ["main"] + ["subagent"] * 4 + ["main"]
    prompts = [server.requests["r"][i]["messages"][1]["content"] for i in (0, 1, 3)]
    assert prompts == [write_value_task(p, w).prompt for p, w in [("a.txt", "red"), ("b.txt", "cat"), ("c.txt", "sun")]]
    main = server.requests["r"][5]["messages"]
    assert main[:4] == server.requests["r"][0]["messages"] + [script[0], ANY_TOOL]
    assert main[4:] == [USER(f"{SUBAGENTS_PREFIX} wrote b.txt; wrote c.txt.")]
    agent_ids = [h.get("X-Agent-Id") for h in server.headers]
    assert agent_ids[1] == agent_ids[2] != agent_ids[3] == agent_ids[4] and agent_ids[0] is agent_ids[5] is None


@pytest.mark.integration
def test_without_subagents_the_main_agent_does_the_whole_task(tmp_path):
    task = echo_files_task({"a.txt": "red", "b.txt": "cat"})
    script = [tool_reply("write_file", 0, path="a.txt", content="red"),
              tool_reply("write_file", 1, path="b.txt", content="cat"), tool_reply("finish", 2)]  # fmt: skip
    outcome, server = rollout(task, script, tmp_path)
    assert outcome.grade.score == 1.0 and roles_seen(server, "r") == ["main"] * 3
    assert server.requests["r"][0]["messages"][1]["content"] == task.prompt


@pytest.mark.integration
def test_a_reply_without_a_usable_tool_call_is_asked_again(tmp_path):
    """The same request again (the dropped reply a dead branch), up to reply_retries times; then it ends."""
    task = write_value_task("answer.txt", "apple")
    bad_call = {
        **tool_reply("write_file", 0),
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "write_file", "arguments": "{not json"}}],
    }
    script = [text_reply("hmm"), tool_reply("write_file", 0, path="answer.txt", content="apple"),
              bad_call, tool_reply("rm", 1), tool_reply("finish", 1)]  # fmt: skip
    outcome, server = rollout(task, script, tmp_path, reply_retries=2)
    assert (outcome.stop_reason, outcome.grade.score, outcome.turns) == ("finish", 1.0, 2)
    requests = server.requests["r"]
    assert requests[0] == requests[1] and requests[2] == requests[3] == requests[4]
    assert json.loads((tmp_path / "r" / "harness" / "result.json").read_text())["retries"] == 3

    outcome, server = rollout(task, [text_reply("no"), text_reply("still no")], tmp_path / "again", reply_retries=1)
    assert (outcome.stop_reason, outcome.turns, outcome.grade.score) == ("no_tool_call", 1, 0.0)
    assert len(server.requests["r"]) == 2


class _AnyTool:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, dict) and other.get("role") == "tool"


ANY_TOOL = _AnyTool()


def USER(text: str) -> dict[str, str]:  # noqa: N802
    return {"role": "user", "content": text}
