"""Running one rollout: workspace, harness subprocess in its own process group, time limit, grading.

The harness is a black box: the runner only gives it a base URL, a workspace and a task file, and
reads back the workspace (graded) and an optional result file (turns, stop reason). At the wall
clock limit the whole process group is killed (SIGTERM, then SIGKILL after a grace period), so
tools and sub-processes die with it, and the preserved workspace is still graded (status timeout).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gyre
from gyre.config.schema import HarnessConfig, TaskConfig
from gyre.tasks.grading import Grade, grade_workspace
from gyre.tasks.task import Task

KILL_GRACE_S = 2.0
STDERR_TAIL_CHARS = 2000


@dataclass(frozen=True)
class HarnessLaunch:
    """What a harness command is built from; paths are absolute."""

    base_url: str
    rollout_id: str
    workspace: Path
    task_file: Path
    result_file: Path
    max_turns: int
    max_tokens: int
    temperature: float
    tool_delay: float
    tool_time: float = 0.0
    tool_time_sigma: float = 1.0


def harness_argv(module: str, launch: HarnessLaunch) -> list[str]:
    """`python -m <module>` with what every harness process gets: proxy URL, rollout id, workspace, files."""
    return [
        sys.executable, "-m", module,
        "--base-url", launch.base_url,
        "--rollout-id", launch.rollout_id,
        "--workspace", str(launch.workspace),
        "--task-file", str(launch.task_file),
        "--result-file", str(launch.result_file),
        "--max-turns", str(launch.max_turns),
    ]  # fmt: skip


def builtin_command(launch: HarnessLaunch) -> list[str]:
    return [
        *harness_argv("gyre.harness.builtin", launch),
        "--max-tokens", str(launch.max_tokens),
        "--temperature", str(launch.temperature),
        "--tool-delay", str(launch.tool_delay),
        "--tool-time", str(launch.tool_time),
        "--tool-time-sigma", str(launch.tool_time_sigma),
    ]  # fmt: skip


def claude_code_command(launch: HarnessLaunch) -> list[str]:
    """Harness kind "claude_code" (gyre.harness.claude_code; max_tokens/temperature are Claude Code's own)."""
    return harness_argv("gyre.harness.claude_code", launch)


HARNESS_COMMANDS: dict[str, Callable[[HarnessLaunch], list[str]]] = {
    "builtin": builtin_command,
    "claude_code": claude_code_command,
}


@dataclass
class RolloutOutcome:
    rollout_id: str
    task: Task
    grade: Grade
    wall_s: float
    turns: int
    stop_reason: str
    timed_out: bool
    stderr_tail: str = ""
    errors: list[str] = field(default_factory=list)
    workdir: Path | None = None
    pid: int | None = None  # the harness process, leader of its own process group

    def summary(self) -> dict[str, Any]:
        """JSON-ready record without the task body."""
        return {
            "rollout_id": self.rollout_id, "task_id": self.task.task_id, "family": self.task.family,
            "grade": self.grade.to_dict(), "wall_s": self.wall_s, "turns": self.turns,
            "stop_reason": self.stop_reason, "timed_out": self.timed_out, "errors": self.errors,
        }  # fmt: skip


def live_group_members(pgid: int) -> list[int]:
    """PIDs of processes in group `pgid` that are not zombies (Linux /proc; elsewhere a signal-0 probe)."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(pgrp) == pgid and state not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


async def _terminate_group(proc: asyncio.subprocess.Process, grace_s: float) -> None:
    """SIGTERM the group, give it `grace_s` to exit, then SIGKILL whatever is left."""
    _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while live_group_members(proc.pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    _signal_group(proc.pid, signal.SIGKILL)
    await proc.wait()


def _read_result(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _tail(path: Path, n: int = STDERR_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _harness_env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(gyre.__file__).resolve().parent.parent)  # importable even when gyre is not installed
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def openai_base_url(url: str) -> str:
    """Accept a proxy root (`http://host:port`) or an OpenAI base URL (`.../v1`); return the latter."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def run_rollout(
    task: Task,
    rollout_id: str,
    base_url: str,
    workdir: str | Path,
    harness_cfg: HarnessConfig,
    task_cfg: TaskConfig | None = None,
    *,
    kill_grace_s: float = KILL_GRACE_S,
) -> RolloutOutcome:
    """Run the configured harness on `task` in `workdir`/workspace against the proxy at `base_url`,
    then grade the workspace (`task_cfg` gives tool_delay_s and check_timeout_s). Cancelling this
    coroutine kills the harness's process group."""
    task_cfg = task_cfg or TaskConfig()
    if harness_cfg.kind not in HARNESS_COMMANDS:
        raise ValueError(f"unknown harness kind {harness_cfg.kind!r}; known: {sorted(HARNESS_COMMANDS)}")
    workdir = Path(workdir).resolve()
    workspace = workdir / "workspace"
    if workspace.exists():
        raise FileExistsError(f"{workspace} already exists; give each rollout its own workdir")
    task.materialize(workspace)
    launch = HarnessLaunch(
        base_url=openai_base_url(base_url),
        rollout_id=rollout_id,
        workspace=workspace,
        task_file=workdir / "task.json",
        result_file=workdir / "result.json",
        max_turns=min(harness_cfg.max_turns, task.max_turns),
        max_tokens=harness_cfg.max_tokens,
        temperature=harness_cfg.temperature,
        tool_delay=task_cfg.tool_delay_s,
        tool_time=task_cfg.tool_time_s,
        tool_time_sigma=task_cfg.tool_time_sigma,
    )
    launch.task_file.write_text(json.dumps(task.harness_view()))
    log_path = workdir / "harness.log"
    start = time.monotonic()
    timed_out = False
    with open(log_path, "wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *HARNESS_COMMANDS[harness_cfg.kind](launch),
            cwd=workspace,
            env=_harness_env(),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    try:
        try:
            await asyncio.wait_for(proc.wait(), timeout=harness_cfg.timeout_s)
        except TimeoutError:
            timed_out = True
            await _terminate_group(proc, kill_grace_s)
    finally:  # sweep what the harness left in its group; if we were cancelled, leave nothing running
        _signal_group(proc.pid, signal.SIGKILL)
    wall_s = time.monotonic() - start

    result = _read_result(launch.result_file)
    stop_reason = "timeout" if timed_out else result.get("stop_reason", "no_result")
    errors = list(result.get("errors", []))
    stderr_tail = _tail(log_path)
    if not timed_out and (proc.returncode != 0 or stop_reason == "api_error"):
        last_lines = stderr_tail.strip().splitlines()
        why = errors[-1] if errors else (last_lines[-1] if last_lines else "no output")
        grade = Grade.failed(f"harness failed (exit code {proc.returncode}, {stop_reason}): {why}")
    else:
        grade = await asyncio.to_thread(
            grade_workspace, task, workspace, timed_out=timed_out, check_timeout_s=task_cfg.check_timeout_s,
            scratch_dir=workdir / "grade",
        )  # fmt: skip
    return RolloutOutcome(
        rollout_id=rollout_id,
        task=task,
        grade=grade,
        wall_s=wall_s,
        turns=int(result.get("turns", 0)),
        stop_reason=stop_reason,
        timed_out=timed_out,
        stderr_tail=stderr_tail,
        errors=errors,
        workdir=workdir,
        pid=proc.pid,
    )


async def run_rollouts(
    jobs: Sequence[tuple[Task, str]],
    base_url: str,
    root: str | Path,
    harness_cfg: HarnessConfig,
    task_cfg: TaskConfig | None = None,
) -> list[RolloutOutcome]:
    """Run (task, rollout_id) jobs, at most `harness_cfg.concurrency` at once, each in root/rollout_id."""
    limit = asyncio.Semaphore(max(1, harness_cfg.concurrency))

    async def one(task: Task, rollout_id: str) -> RolloutOutcome:
        async with limit:
            return await run_rollout(task, rollout_id, base_url, Path(root) / rollout_id, harness_cfg, task_cfg)

    return list(await asyncio.gather(*(one(task, rid) for task, rid in jobs)))
