"""Running one rollout: workspace, sandboxed harness, time limit, grading of a copy, failure attribution.

The harness is a black box: the runner gives it an OpenAI base URL (its own proxy endpoint), a key
that only this rollout holds, a workspace and a task file, and reads back the workspace (graded)
and an optional result file (turns, stop reason). It runs in the configured sandbox
(gyre/sandbox): with bwrap or apptainer the workspace is its only writable path and the endpoint its
only way out, and ending the sandbox ends every process it started. At the wall clock limit the
sandbox (its process group) is killed (SIGTERM, then SIGKILL after a grace period), and the
preserved workspace is still graded (status timeout). Once nothing of the harness runs, a copy of
the workspace is graded in a fresh sandbox (gyre/tasks/grading.py); a failed harness is excluded
only when its endpoint saw the proxy fail, else scored 0 (gyre/harness/attribution.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.config.schema import HarnessConfig, SandboxConfig, TaskConfig
from gyre.fsutil import scratch_dir
from gyre.harness.attribution import harness_failure
from gyre.harness.endpoint import DEFAULT_MAX_CONNECTIONS, ProxyEndpoint
from gyre.harness.kinds import HarnessLaunch, HarnessSpec, harness_spec
from gyre.lifetime import tied_to_this_thread
from gyre.proxy.keys import RolloutKeys
from gyre.sandbox import Mount, Sandbox, SandboxJob, make_sandbox, place
from gyre.sandbox.base import HARNESS_DIR, RELAY_PORT, WORKSPACE, code_mounts, host_env
from gyre.sandbox.limits import connections_per_rollout
from gyre.tasks.grading import Grade, grade_workspace
from gyre.tasks.harbor_root import agent_overlay
from gyre.tasks.task import Task

log = logging.getLogger(__name__)
KILL_GRACE_S = 2.0
STDERR_TAIL_CHARS = 2000


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


def _read_result(path: Path) -> dict[str, Any] | None:
    """The harness's result file (agent-writable: read defensively); None when missing or not a JSON object."""
    try:
        with open(path, "rb") as f:  # bounded: the agent may have made it huge
            data = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _tail(path: Path, n: int = STDERR_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def openai_base_url(url: str) -> str:
    """Accept a proxy root (`http://host:port`) or an OpenAI base URL (`.../v1`); return the latter."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def agent_timeout(harness_cfg: HarnessConfig, task: Task) -> float:
    """The harness's wall clock limit: harness.timeout_s, or the task's own agent timeout when shorter."""
    if task.agent_timeout_s is None:
        return harness_cfg.timeout_s
    return min(harness_cfg.timeout_s, task.agent_timeout_s)


@dataclass
class _Harness:
    returncode: int | None
    timed_out: bool
    started: bool
    wall_s: float


async def _run_harness(
    sandbox: Sandbox, job: SandboxJob, log_path: Path, timeout_s: float, kill_grace_s: float
) -> tuple[_Harness, int]:
    """Run the sandboxed job to its end (or kill it at `timeout_s`); (what happened, the leader's pid)."""
    read_fd, write_fd = os.pipe() if sandbox.isolated else (-1, -1)
    job.started_fd = write_fd
    start = time.monotonic()
    timed_out = False
    # this thread waits on it: it ends with the run, even SIGKILLed
    argv, preexec_fn = tied_to_this_thread(sandbox.command(job))
    try:
        with open(log_path, "wb") as log_file:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=job.cwd if not sandbox.isolated else "/",
                env=host_env(sandbox, job),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                start_new_session=True,
                preexec_fn=preexec_fn,
                pass_fds=(write_fd,) if write_fd >= 0 else (),
            )
    finally:
        if write_fd >= 0:
            os.close(write_fd)
    try:
        try:
            await asyncio.wait_for(proc.wait(), timeout=timeout_s)
        except TimeoutError:
            timed_out = True
            await _terminate_group(proc, kill_grace_s)
    finally:  # sweep what the harness left in its group; if we were cancelled, leave nothing running
        _signal_group(proc.pid, signal.SIGKILL)
        started = True
        if read_fd >= 0:
            os.set_blocking(read_fd, False)
            try:
                started = os.read(read_fd, 64).startswith(b"started")
            except BlockingIOError:
                started = False
            os.close(read_fd)
    return _Harness(proc.returncode, timed_out, started, time.monotonic() - start), proc.pid


async def run_rollout(
    task: Task,
    rollout_id: str,
    base_url: str,
    workdir: str | Path,
    harness_cfg: HarnessConfig,
    task_cfg: TaskConfig | None = None,
    *,
    sandbox: Sandbox | None = None,
    keys: RolloutKeys | None = None,
    kill_grace_s: float = KILL_GRACE_S,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    on_harness_end: Callable[[], None] | None = None,
) -> RolloutOutcome:
    """Run the configured harness on `task` in `workdir`/workspace, sandboxed (default: bwrap), against
    the proxy at `base_url`, then grade a copy of the workspace (`task_cfg` gives tool_delay_s and
    check_timeout_s). With `keys`, the harness gets a key for this rollout alone, revoked at the end.
    `on_harness_end()` is called once the harness has ended and its key and proxy endpoint are closed,
    before grading: from then on the rollout makes no model call, so the caller can give its session slot
    to another (a SWE-bench instance's tests can run for minutes). Cancelling this coroutine kills the
    harness's sandbox."""
    sandbox = sandbox or make_sandbox(SandboxConfig())
    kind = harness_spec(harness_cfg.kind)
    r = _Rollout(task, rollout_id, Path(workdir).resolve(), sandbox, task_cfg or TaskConfig(), harness_cfg, kind)
    if r.workspace.exists():
        raise FileExistsError(f"{r.workspace} already exists; give each rollout its own workdir")
    task.materialize(r.workspace)
    r.harness_dir.mkdir()
    key = keys.issue(rollout_id) if keys is not None else "none"
    with scratch_dir("gyre-ep-") if sandbox.isolated else nullcontext(None) as sock_dir:
        endpoint = ProxyEndpoint(base_url, sock_dir / "proxy.sock" if sock_dir else None, max_connections)
        try:  # from here on a cancellation (a run stopped while sessions start) still closes and revokes
            await endpoint.start()
            job = _sandbox_job(r, endpoint, key)
            try:
                run, pid = await _run_harness(sandbox, job, r.log_path, agent_timeout(harness_cfg, task), kill_grace_s)
            finally:
                if job.overlay is not None:
                    job.overlay.release()
        finally:
            await endpoint.close()
            if keys is not None:
                keys.revoke(key)
    if on_harness_end is not None:
        on_harness_end()
    return await _outcome(r, run, pid, endpoint)


@dataclass(frozen=True)
class _Rollout:
    """One rollout's task, directories and settings, as its steps (sandbox job, outcome) share them."""

    task: Task
    rollout_id: str
    workdir: Path  # absolute
    sandbox: Sandbox
    task_cfg: TaskConfig
    harness_cfg: HarnessConfig
    kind: HarnessSpec

    @property
    def workspace(self) -> Path:
        return self.workdir / "workspace"

    @property
    def harness_dir(self) -> Path:
        return self.workdir / "harness"

    @property
    def log_path(self) -> Path:
        return self.workdir / "harness.log"


def _sandbox_job(r: _Rollout, endpoint: ProxyEndpoint, key: str) -> SandboxJob:
    """The harness's sandbox job: the workspace and its own I/O directory mounted, the proxy through `endpoint`."""
    sandbox, task, harness_cfg, kind = r.sandbox, r.task, r.harness_cfg, r.kind
    ws_mount, io_mount = Mount(r.workspace, WORKSPACE, writable=True), Mount(r.harness_dir, HARNESS_DIR, writable=True)
    # a task's image may expect its files elsewhere (Harbor's WORKDIR, e.g. /app): the same workspace there too
    also = [Mount(r.workspace, task.workdir, writable=True)] if task.workdir and sandbox.isolated else []
    inside_io = place(sandbox, io_mount)
    launch = HarnessLaunch(
        base_url=f"http://127.0.0.1:{RELAY_PORT}/v1" if sandbox.isolated else openai_base_url(endpoint.url),
        rollout_id=r.rollout_id,
        workspace=Path(place(sandbox, ws_mount)),
        task_file=Path(inside_io) / "task.json",
        result_file=Path(inside_io) / "result.json",
        max_turns=min(harness_cfg.max_turns, task.max_turns),
        max_tokens=harness_cfg.max_tokens,
        temperature=harness_cfg.temperature,
        tool_delay=r.task_cfg.tool_delay_s,
        tool_time=r.task_cfg.tool_time_s,
        tool_time_sigma=r.task_cfg.tool_time_sigma,
        python=kind.python(sandbox),
        bare=harness_cfg.bare,
        compact_tokens=harness_cfg.compact_tokens,
        subagents=harness_cfg.subagents,
        reply_retries=harness_cfg.reply_retries,
    )
    (r.harness_dir / "task.json").write_text(json.dumps(task.harness_view()))
    return SandboxJob(
        argv=kind.command(launch),
        cwd=str(launch.workspace),
        env=kind.env(key, inside_io),
        mounts=[*code_mounts(), ws_mount, *also, io_mount],
        proxy_socket=endpoint.unix_path,
        image=task.image,
        overlay=agent_overlay(task, sandbox, r.workspace),  # a Harbor task's image root, writable, kept for grading
    )


async def _outcome(r: _Rollout, run: _Harness, pid: int, endpoint: ProxyEndpoint) -> RolloutOutcome:
    """What the harness left (its result file and trace), graded: a failure of the harness or its infrastructure
    from what was seen (gyre.harness.attribution), else the workspace's copy graded in a fresh sandbox."""
    r.kind.copy_out_trace(r.harness_dir)
    result = _read_result(r.harness_dir / "result.json")
    stop_reason = "timeout" if run.timed_out else (result or {}).get("stop_reason", "no_result")
    if endpoint.context_overflows and not run.timed_out:
        stop_reason = "context_limit"
    errors = [str(e) for e in (result or {}).get("errors", [])] if isinstance(result, dict) else []
    stderr_tail = _tail(r.log_path)
    grade = harness_failure(
        started=run.started, returncode=run.returncode, timed_out=run.timed_out, result=result,
        endpoint_failures=endpoint.failures, stderr_tail=stderr_tail, context_overflows=endpoint.context_overflows,
        overflow_before_any_answer=endpoint.overflow_before_any_answer,
    )  # fmt: skip
    if grade is None:
        grade = await asyncio.to_thread(
            grade_workspace, r.task, r.workspace, timed_out=run.timed_out, check_timeout_s=r.task_cfg.check_timeout_s,
            sandbox=r.sandbox,
        )  # fmt: skip
    return RolloutOutcome(
        rollout_id=r.rollout_id,
        task=r.task,
        grade=grade,
        wall_s=run.wall_s,
        turns=_int((result or {}).get("turns")),
        stop_reason=str(stop_reason),
        timed_out=run.timed_out,
        stderr_tail=stderr_tail,
        errors=errors,
        workdir=r.workdir,
        pid=pid,
    )


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


async def run_rollouts(
    jobs: Sequence[tuple[Task, str]],
    base_url: str,
    root: str | Path,
    harness_cfg: HarnessConfig,
    task_cfg: TaskConfig | None = None,
    *,
    sandbox: Sandbox | None = None,
    keys: RolloutKeys | None = None,
    on_done: Callable[[int, RolloutOutcome], None] | None = None,
) -> list[RolloutOutcome]:
    """Run (task, rollout_id) jobs, at most `harness_cfg.concurrency` at once, each in root/rollout_id;
    `on_done(index, outcome)` as each one ends (the caller writes a group's shard once it is complete)."""
    limit = asyncio.Semaphore(max(1, harness_cfg.concurrency))  # harnesses at once; grading holds no place
    sandbox = sandbox or make_sandbox(SandboxConfig())
    wanted = getattr(getattr(sandbox, "cfg", None), "relay_connections", DEFAULT_MAX_CONNECTIONS)
    connections = connections_per_rollout(wanted, min(len(jobs), max(1, harness_cfg.concurrency)))

    async def one(index: int, task: Task, rollout_id: str) -> RolloutOutcome:
        await limit.acquire()
        held = True

        def release() -> None:  # at the harness's end (its grading needs no place), else when it failed
            nonlocal held
            if held:
                held = False
                limit.release()

        try:
            outcome = await run_rollout(
                task, rollout_id, base_url, Path(root) / rollout_id, harness_cfg, task_cfg, sandbox=sandbox, keys=keys,
                max_connections=connections, on_harness_end=release,
            )  # fmt: skip
        finally:
            release()
        if on_done is not None:
            on_done(index, outcome)
        return outcome

    return list(await asyncio.gather(*(one(i, task, rid) for i, (task, rid) in enumerate(jobs))))
