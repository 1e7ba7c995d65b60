"""Grading a workspace: a copy of it, in a fresh sandbox, with the task's checker as its own process.

Outcomes: "ok" (graded), "timeout" (the harness was killed at its time limit; the preserved
workspace is graded all the same), "agent_failed" (the agent broke its side: its harness exited
non-zero or broke the protocol, its code ended or stopped the checker or went past its limits; score 0,
trained, reason recorded), "failed" (the evaluation itself broke: the sandbox did not start, the checker
crashed, hung or printed garbage before any of the agent's code ran, or said the task is broken; the
workspace is gone, grading hit an OSError). A failed grade has score None and must be excluded from
training, never counted as a zero.

Who broke it is observed, not read from an exit code the agent's code can choose (any signal, a stop):
the checker reports over a channel of its own (gyre.tasks.checker_report) the moment before the agent's
code first runs, then its verdict. No verdict after that moment, however the checker ended, is the
agent's failure (checker_killed, checker_stopped, grading_interrupted); no verdict before it is a failed
grade.

What the agent cannot touch: the workspace is copied without following links (symlinks stay links,
only regular files and directories are copied) into a new directory; only then do the checker and
its spec exist, and never as files: the checker's source and spec reach it on stdin, the spec as an
anonymous memory file, and the checker marks itself non-dumpable, so agent code it runs (as the same
user, in the same sandbox, without capabilities) can open neither its /proc files nor its memory, nor
take its report socket. The verdict is what the checker prints, captured in its own process and sent on
that socket; its stdout, which its parent in the sandbox shares, carries nothing. Under backend none a
root agent has ptrace rights over the checker: none promises none of this.

A task's hidden files (Harbor's tests/) are written only here, after the agent has finished, into a
private directory the grading sandbox sees at /tests (a Harbor task's tests may add files there, never change
the task's own: tests_mounts); a Harbor task's verifier writes its reward under
/logs, a fresh writable directory of this sandbox alone, read by the checker inside it, where the reward
guard keeps the programs of the tests from writing it (gyre.tasks.harbor_checker).
"""

from __future__ import annotations

import base64
import errno
import json
import math
import os
import shutil
import signal
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.config.schema import SandboxConfig
from gyre.fsutil import scratch_dir
from gyre.lifetime import tied_to_this_thread
from gyre.sandbox import Mount, Sandbox, SandboxJob, place
from gyre.sandbox.backends import NoSandbox
from gyre.sandbox.base import WORKSPACE, code_mounts, host_env
from gyre.sandbox.overlay import RootOverlay
from gyre.tasks import checker, harbor_checker, swebench_checker
from gyre.tasks.checker_report import CheckerReport, ReportListener
from gyre.tasks.harbor_root import grading_overlay
from gyre.tasks.offline_tests import PIP_DIR, UV_DIR
from gyre.tasks.reward_guard import GuardUnavailable, reward_guard_library
from gyre.tasks.task import Task

BUILTIN_CHECKER = Path(checker.__file__)
CHECKERS = {"builtin": BUILTIN_CHECKER, "harbor": Path(harbor_checker.__file__),
            "swebench": Path(swebench_checker.__file__)}  # fmt: skip
TESTS_DIR, LOGS_DIR = "/tests", "/logs"  # Harbor's paths for the tests and the verifier's output
# Reason codes of agent_failed grades (the part of Grade.reason before ": ")
AGENT_FAILURES = {
    "harness_exit": "the harness exited non-zero, no proxy failure seen",
    "harness_protocol": "the harness wrote no valid result file, or reported an API error the proxy never gave",
    "checker_killed": "the checker died of a signal once the agent's code had started",
    "checker_stopped": "the checker did not finish in its time once the agent's code had started (stopped, starved)",
    "grading_interrupted": "the checker ended without a verdict once the agent's code had started",
    "workspace_limits": "the workspace cannot be graded within the limits (too many files or bytes)",
    "tests_timeout": "the task's tests, running the agent's code, ran past their time",
    "tests_killed": "the task's tests, running the agent's code, died of a signal",
    "tests_left_processes": "a process started under the task's tests outlived them (it could rewrite the reward)",
    "tests_incomplete": "the test runner ended without its own completion record (the code under test ended it)",
}
TESTS_BUDGET_FRACTION = 0.8  # of the checker's time limit, for a task's own tests (gyre.tasks.agent_code)
PYTHON_BUDGET_FRACTION = 0.6  # of the checker's time limit, for all the workspace's programs together
SANDBOX_START_S = 2.0  # added to the checker's time limit in an isolated sandbox: starting it is not the checker's
MAX_WORKSPACE_FILES = 100_000
MAX_WORKSPACE_BYTES = 2 << 30  # on disk (allocated blocks)
MAX_WORKSPACE_APPARENT_BYTES = 4 << 30  # as read (sparse files at their full size)
COPY_CHUNK = 1 << 20
REWARD_GUARD = "/run/gyre/reward_guard.so"  # the guard library, inside an isolated sandbox
REPORT_SOCKET = "/run/gyre/report.sock"  # the checker's report channel, inside an isolated sandbox
REPORT_JOIN_S = 5.0  # once the checker has ended, how long its last report may take to be read
# Runs the checker: reads {"source", "spec", "gyre_root", "report", "nonce"} from stdin, becomes non-dumpable
# (PR_SET_DUMPABLE = 4), connects its report channel, hands the spec over as an anonymous memory file, runs
# the source as `checker.py <spec path>` with its stdout captured, and reports that output as its verdict.
_CHECKER_BOOT = (
    "import ctypes, io, json, os, sys\n"
    "ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)\n"
    "job = json.load(sys.stdin)\n"
    "sys.path.insert(0, job['gyre_root'])\n"
    "from gyre.tasks import agent_code\n"
    "agent_code.open_report(job['report'], job['nonce'])\n"
    "fd = os.memfd_create('spec.json')\n"
    "os.write(fd, job['spec'].encode())\n"
    "os.lseek(fd, 0, 0)\n"
    "sys.argv = ['checker.py', '/proc/self/fd/%d' % fd]\n"
    "sys.stdout = out = io.StringIO()\n"
    "try:\n"
    "    exec(compile(job['source'], 'checker.py', 'exec'), {'__name__': '__main__'})\n"
    "except SystemExit as e:\n"
    "    if e.code not in (None, 0):\n"
    "        raise\n"
    "agent_code.report_verdict(out.getvalue())\n"
)


class WorkspaceTooLarge(Exception):
    pass


@dataclass(frozen=True)
class Grade:
    status: str  # "ok" | "timeout" | "agent_failed" | "failed"
    # the checker's score, else the fraction of checks passed (0 when agent_failed); None when failed
    score: float | None
    passed: int = 0
    total: int = 0
    reason: str = ""
    checks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def success(self) -> bool:
        return self.status != "failed" and self.total > 0 and self.passed == self.total

    @classmethod
    def failed(cls, reason: str) -> Grade:
        return cls(status="failed", score=None, reason=reason)

    @classmethod
    def agent_failed(cls, code: str, detail: str) -> Grade:
        """Score 0 for a failure the agent caused; `code` is one of AGENT_FAILURES."""
        assert code in AGENT_FAILURES, code
        return cls(status="agent_failed", score=0.0, reason=f"{code}: {detail}")

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "success": self.success}


def _tail(text: str, n: int = 400) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def _parse_results(stdout: str) -> tuple[list[dict[str, Any]], float | None, str | None]:
    """(results, the checker's own score or None: then the fraction of results passed, the agent failure
    it reports as 'code: detail' or None)."""
    lines = stdout.strip().splitlines()
    if not lines:
        raise ValueError("checker printed nothing")
    out = json.loads(lines[-1])
    results, score = out["results"], out.get("score")
    if score is not None and (
        isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score)
    ):
        raise ValueError(f"checker score {score!r} is not a finite number")
    if not isinstance(results, list) or not results:
        raise ValueError("checker reported no results")
    for r in results:
        if not isinstance(r, dict) or not isinstance(r.get("passed"), bool) or "name" not in r:
            raise ValueError(f"malformed check result {r!r}")
    failure = out.get("agent_failed")
    if failure is not None and (not isinstance(failure, str) or failure.partition(": ")[0] not in AGENT_FAILURES):
        raise ValueError(f"checker reports an unknown agent failure {failure!r}")
    return results, None if score is None else float(score), failure


def copy_workspace(src: Path, dst: Path) -> None:
    """Copy a tree without following links: directories and regular files, symlinks as links, nothing else.

    Within a budget of entries, of bytes on disk and of apparent bytes (a sparse file's holes: what a reader
    sees); beyond any, WorkspaceTooLarge (the agent's failure). Holes stay holes in the copy, so a sparse
    file costs the host what it costs in the workspace, not its apparent size."""
    files = allocated = apparent = 0
    dst.mkdir(mode=0o755)
    for root, dirs, names in os.walk(src, followlinks=False):
        rel = Path(root).relative_to(src)
        for name in [*dirs, *names]:
            source, target = Path(root) / name, dst / rel / name
            st = os.lstat(source)
            files += 1
            if files > MAX_WORKSPACE_FILES:
                raise WorkspaceTooLarge(f"more than {MAX_WORKSPACE_FILES} entries")
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(source), target)
            elif stat.S_ISDIR(st.st_mode):
                target.mkdir(mode=0o755)
            elif stat.S_ISREG(st.st_mode):
                allocated += st.st_blocks * 512
                apparent += st.st_size
                if allocated > MAX_WORKSPACE_BYTES:
                    raise WorkspaceTooLarge(f"more than {MAX_WORKSPACE_BYTES >> 20} MiB on disk")
                if apparent > MAX_WORKSPACE_APPARENT_BYTES:
                    raise WorkspaceTooLarge(f"files of more than {MAX_WORKSPACE_APPARENT_BYTES >> 20} MiB in all "
                                            "(sparse files counted at their apparent size)")  # fmt: skip
                fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd, "rb") as f_in, open(target, "xb") as f_out:
                    _copy_keeping_holes(f_in.fileno(), f_out.fileno(), st.st_size)
        dirs[:] = [d for d in dirs if not os.path.islink(Path(root) / d)]


def _copy_keeping_holes(src: int, dst: int, size: int) -> None:
    """Copy the data regions of `src` (SEEK_DATA/SEEK_HOLE) to the same offsets of `dst`; holes stay holes."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(src, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole from pos to the end
                break
            raise
        end = os.lseek(src, start, os.SEEK_HOLE)
        os.lseek(src, start, os.SEEK_SET)
        os.lseek(dst, start, os.SEEK_SET)
        while start < end:
            chunk = memoryview(os.read(src, min(COPY_CHUNK, end - start)))
            if not chunk:
                break
            start += len(chunk)
            while chunk:
                chunk = chunk[os.write(dst, chunk) :]
        pos = end
    os.ftruncate(dst, size)


def _grading_mounts(task: Task, sandbox: Sandbox, scratch: Path, copy: Path) -> tuple[list[Mount], dict[str, str]]:
    """The mounts of the grading sandbox besides the code, and where the spec finds them."""
    ws = Mount(copy, WORKSPACE, writable=True)
    mounts, where = [ws], {"workspace": place(sandbox, ws), "workdir": place(sandbox, ws)}
    if task.workdir and sandbox.isolated:
        mounts.append(Mount(copy, task.workdir, writable=True))
        where["workdir"] = task.workdir
    if task.hidden_files:
        tests = tests_mounts(task, scratch, writable=task.checker == "harbor" and sandbox.isolated)
        mounts += tests
        where["tests_dir"] = place(sandbox, tests[0])
    if sandbox.isolated:
        mounts += offline_test_mounts(task, scratch)
    if task.checker == "harbor":
        (scratch / "logs").mkdir()
        mounts.append(Mount(scratch / "logs", LOGS_DIR, writable=True))
        where["logs_dir"] = place(sandbox, mounts[-1])
        mounts.append(Mount(reward_guard_library(), REWARD_GUARD))
        where["reward_guard"] = place(sandbox, mounts[-1])
    return mounts, where


def tests_mounts(task: Task, scratch: Path, writable: bool) -> list[Mount]:
    """The task's hidden files written into scratch/tests, a private copy made after the agent has ended, and
    mounted at /tests. `writable` (Harbor, as Harbor copies the tests into its container: tests that write
    /tests/score.txt): the directory takes new files, while each file of the task stays read-only, bound over
    itself, so that the agent's code the tests run cannot rewrite the script (bash reads it as it goes) or a
    file it sources: what the test script's shell runs stays the task's own."""
    tests = scratch / "tests"
    for rel, content in task.hidden_files.items():
        path = tests / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(content))
    if not writable:
        return [Mount(tests, TESTS_DIR)]
    files = [Mount(tests / rel, f"{TESTS_DIR}/{rel}") for rel in sorted(task.hidden_files)]
    return [Mount(tests, TESTS_DIR, writable=True), *files]


def offline_test_mounts(task: Task, scratch: Path) -> list[Mount]:
    """What gyre/tasks/offline_tests.py prepared for the task's tests at build time: uv and a copy of its cache
    (uv writes to it), the packages its pip installs name, the host interpreters uvx asked for. Every run of the
    tests needs them: grading and the oracle check's showing of the tests' output alike."""
    if not task.grading.get("offline_tests"):
        return []
    prepared = Path(task.grading["offline_tests"])
    shutil.copytree(prepared / "cache", scratch / "uv-cache", symlinks=True)
    mounts = [Mount(prepared / "bin", f"{UV_DIR}/bin"), Mount(scratch / "uv-cache", f"{UV_DIR}/cache", writable=True)]
    if (prepared / "pip").is_dir():
        mounts.append(Mount(prepared / "pip", PIP_DIR))
    return mounts + [Mount(Path(prefix), prefix) for prefix in task.grading.get("offline_pythons", [])]


def _checker_inputs(task: Task) -> dict[str, Any]:
    """What a format's checker needs from the task's own tree: SWE-bench, the tree's paths and runner files."""
    if task.checker != "swebench":
        return {}
    return {"original_files": sorted(task.files), "runner_files": swebench_checker.runner_files(task.files)}


def _run_checker(
    sandbox: Sandbox,
    source: str,
    spec: dict[str, Any],
    mounts: list[Mount],
    timeout_s: float,
    scratch: Path,
    image: str = "",
    overlay: RootOverlay | None = None,
) -> tuple[int | None, str, CheckerReport]:
    """(returncode or None on timeout, stderr, what it reported) of the checker in a fresh sandbox with `mounts`."""
    report = Mount(scratch / "report.sock", REPORT_SOCKET, writable=True)
    mounts = [*code_mounts(), *mounts, report]
    job = SandboxJob(argv=[sandbox.python, "-I", "-S", "-c", _CHECKER_BOOT], cwd="/tmp" if sandbox.isolated else "/",
                     mounts=mounts, image=image, overlay=overlay)  # fmt: skip
    # this thread waits on it: it ends with the run, even SIGKILLed
    command, preexec_fn = tied_to_this_thread(sandbox.command(job))
    listener = ReportListener(report.source)
    try:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,  # not the verdict's way: the checker's parent in the sandbox holds it too
            stderr=subprocess.PIPE,
            text=True,
            env=host_env(sandbox, job),
            start_new_session=True,
            preexec_fn=preexec_fn,
        )
    except OSError:
        listener.finish(0.0)
        raise
    try:
        gyre_root = str(Path(place(sandbox, mounts[1])).parent)  # code_mounts(): the gyre package second
        job_input = json.dumps({"source": source, "spec": json.dumps(spec), "gyre_root": gyre_root,
                                "report": place(sandbox, report), "nonce": listener.nonce})  # fmt: skip
        _, err = proc.communicate(job_input, timeout=timeout_s + (SANDBOX_START_S if sandbox.isolated else 0.0))
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
    try:  # sweep anything the checker left behind in its group
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return code, err, listener.finish(REPORT_JOIN_S)


def grade_workspace(
    task: Task,
    workspace: str | Path,
    *,
    timed_out: bool = False,
    check_timeout_s: float = 10.0,
    sandbox: Sandbox | None = None,
) -> Grade:
    """Run the task's hidden checks on a copy of `workspace` in a fresh sandbox (none when None).
    Never raises for what the workspace holds: an OSError becomes a failed grade with its reason."""
    workspace = Path(workspace).resolve()
    if not workspace.is_dir():
        return Grade.failed(f"workspace {workspace} does not exist")
    if not task.checks and task.checker_source is None and task.checker == "builtin":
        return Grade.failed(f"task {task.task_id} has no checks")
    if task.checker not in CHECKERS:
        return Grade.failed(f"task {task.task_id} names checker {task.checker!r}; known: {sorted(CHECKERS)}")
    sandbox = sandbox or NoSandbox(SandboxConfig(backend="none"))
    if task.checker == "harbor" and not sandbox.isolated:
        return Grade.failed(f"task {task.task_id} ({task.source}): its tests use /tests and /logs, which need an "
                            "isolated sandbox (sandbox.backend=bwrap or apptainer)")  # fmt: skip
    check_timeout_s = task.check_timeout_s or check_timeout_s
    with scratch_dir("gyre-grade-") as scratch:
        try:
            copy = scratch / "workspace"
            copy_workspace(workspace, copy)
            source = task.checker_source if task.checker_source is not None else CHECKERS[task.checker].read_text()
            mounts, where = _grading_mounts(task, sandbox, scratch, copy)
            spec = {
                "checks": task.checks,
                "python_timeout_s": min(5.0, check_timeout_s / 3),
                "python_budget_s": check_timeout_s * PYTHON_BUDGET_FRACTION,
                "tests_timeout_s": check_timeout_s * TESTS_BUDGET_FRACTION,
                "pid_namespace": sandbox.isolated,
                **_checker_inputs(task),
                **task.grading,
                **where,
            }
            targets = [m.target for m in [*code_mounts(), *mounts]] + [REPORT_SOCKET]
            overlay = grading_overlay(task, sandbox, workspace, scratch, targets)
            try:
                code, err, report = _run_checker(
                    sandbox, source, spec, mounts, check_timeout_s, scratch, task.image, overlay
                )
            finally:
                if overlay is not None:
                    overlay.release()
        except WorkspaceTooLarge as e:
            return Grade.agent_failed("workspace_limits", str(e))
        except GuardUnavailable as e:
            return Grade.failed(str(e))
        except OSError as e:
            return Grade.failed(f"grading failed: {type(e).__name__}: {e}")
    return _grade_from(code, err, report, timed_out, check_timeout_s)


def _no_verdict(code: int | None, err: str, report: CheckerReport, check_timeout_s: float) -> Grade:
    """The checker ended without a verdict: the agent's failure once its code had started, else a failed grade."""
    ended = f"timed out after {check_timeout_s:g}s" if code is None else f"exited with code {code}"
    detail = f"checker {ended}: {_tail(err) or '(no stderr)'}"
    if report.broken is not None and not report.agent_code_started:
        return Grade.failed(f"the evaluation broke: {_tail(report.broken)}")
    if report.broken is not None:  # e.g. no reward file: the agent's code ran, and may be why
        return Grade.agent_failed("grading_interrupted", f"the evaluation broke once the agent's code had run: "
                                  f"{_tail(report.broken)}")  # fmt: skip
    if not report.agent_code_started:  # the sandbox did not start, or the checker broke on its own
        return Grade.failed(detail)
    if code is None:
        return Grade.agent_failed("checker_stopped", detail)
    if code < 0 or code > 128:  # a signal (an isolated sandbox's launcher exits 128 + N)
        return Grade.agent_failed("checker_killed", detail)
    return Grade.agent_failed("grading_interrupted", detail)


def _grade_from(code: int | None, err: str, report: CheckerReport, timed_out: bool, check_timeout_s: float) -> Grade:
    if report.verdict is None:
        return _no_verdict(code, err, report, check_timeout_s)
    try:
        results, score, agent_failure = _parse_results(report.verdict)
    except (ValueError, KeyError, TypeError) as e:
        return Grade.failed(f"checker output unreadable ({e}): {_tail(report.verdict, 200)!r}")
    if agent_failure is not None:
        code, _, detail = agent_failure.partition(": ")
        return Grade.agent_failed(code, detail)
    passed = sum(r["passed"] for r in results)
    return Grade(
        status="timeout" if timed_out else "ok",
        score=passed / len(results) if score is None else score,
        passed=passed,
        total=len(results),
        checks=results,
    )
