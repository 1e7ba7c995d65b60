"""The oracle check of a suite on disk: every task's reference solution, and a do-nothing agent, through
the real grading path (what Harbor's oracle and nop agents do for its tasks).

The reference solution of a Harbor task is solution/solve.sh, run like an agent in the task's sandbox
(the workspace writable at /workspace and the working directory, solution/ read-only at /solution,
within the task's agent timeout); of a SWE-bench instance, its `patch`, applied to the workspace. A task
is sound when the oracle gets the full reward (1) and the do-nothing agent less; anything else, or a
grade that fails, makes it broken; a task whose environment cannot be built is skipped.

A broken task's report says why in words a person can act on: the tests (or the solution) need the
network, lack pytest or another tool, or simply give the oracle a wrong answer; and the do-nothing agent
getting the full reward is named whatever else is wrong. For that the task's tests are run once more on
the oracle's workspace, in the same sandbox, with their output kept (grading keeps only the score).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.sandbox import Mount, Sandbox, SandboxJob, place
from gyre.sandbox.base import WORKSPACE, code_mounts, host_env
from gyre.tasks.grading import LOGS_DIR, TESTS_DIR, Grade, grade_workspace, offline_test_mounts, tests_mounts
from gyre.tasks.harbor_checker import _PYTEST_SUMMARY
from gyre.tasks.harbor_root import agent_overlay, grading_overlay
from gyre.tasks.swebench_checker import reset_and_patch
from gyre.tasks.task import GIT_ENV, SkippedTask, Task

SOLUTION_DIR = "/solution"
DEFAULT_SOLVE_TIMEOUT_S = 600.0
TAIL_LINES = 15
VERDICTS = ("sound", "broken", "skipped")
_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")
_WRITES_TESTS = re.compile(
    r"(?:Read-only file system|Permission denied): '(/tests/(?!\.pytest_cache|pytest-cache)[^']*)'"
)
# What a test or solution log says, in the words a task's author can act on (first match wins)
_WRITES_REWARD = re.compile(r"(?:PermissionError|Permission denied).*/logs/verifier/reward\.(?:txt|json)")
_LOG_CAUSES: list[tuple[re.Pattern[str], str]] = [
    (_WRITES_REWARD,
     "writes its reward file from a program test.sh runs, which Gyre's reward guard refuses: only the test "
     "script's own shell may write /logs/verifier/reward.* (the agent's code runs as such programs); "
     "write it from test.sh, e.g. `echo $score > /logs/verifier/reward.txt`"),
    (re.compile(r"Could not resolve host|Temporary failure in name resolution|Name or service not known|"
                r"Network is unreachable|getaddrinfo|Failed to establish a new connection|No address associated|"
                r"Could not fetch URL|Failed to download|error sending request|dns error"),  # fmt: skip
     "needs the network, which tests and solutions do not have (offline at rollout time)"),
    (re.compile(r"No module named '?pytest'?|pytest: (?:command )?not found|uvx?: (?:command )?not found"),
     "needs pytest (or uv), which the environment it runs in lacks"),
    (_NO_MODULE,
     "needs the Python module {0}, which the environment it runs in lacks"),
    (re.compile(r"(?:^|\s)([\w.+-]+): (?:command )?not found", re.MULTILINE),
     "needs `{0}`, which the environment it runs in lacks"),
    (_WRITES_TESTS,
     "writes {0}, but /tests is read-only in grading (Gyre keeps the tests out of reach of the agent's code they "
     "run; Harbor copies them in writable): the task's tests must write elsewhere, e.g. /logs/verifier or /tmp"),
    (re.compile(r"Permission denied|Read-only file system|are you root"),
     "writes where it may not (only the working directory is writable; no root)"),
]  # fmt: skip
_CAUSES_WHILE_TESTS_RUN = {_WRITES_REWARD, _NO_MODULE, _WRITES_TESTS}  # what a log says even when pytest reported


@dataclass(frozen=True)
class BuildOutcome:
    """Whether the task's environment was built: None where no build applies (the host's /usr under bwrap),
    False with the cause when it failed (the task is then skipped)."""

    built: bool | None = None
    cause: str = ""


# The hook an environment builder plugs into (gyre/tasks/images.py): called once per task before it is checked
EnvironmentBuilder = Callable[[Task], BuildOutcome]


def no_build(task: Task) -> BuildOutcome:
    return BuildOutcome(None)


@dataclass
class OracleReport:
    task_id: str
    oracle: Grade | None
    nop: Grade | None
    problem: str = ""  # empty: sound
    verdict: str = "sound"
    built: bool | None = None
    test_output: str = ""  # the last lines of the tests' output on the oracle's workspace (broken tasks)
    solution_output: str = ""  # the last lines of the solution's output (broken Harbor tasks)
    causes: list[str] = field(default_factory=list)

    @property
    def broken(self) -> bool:
        return self.verdict != "sound"

    def line(self) -> str:
        def g(grade: Grade | None) -> str:
            if grade is None:
                return "-"
            return f"{grade.score:g}" if grade.score is not None else "failed"  # the cause says why

        if self.verdict == "skipped":
            return f"{self.task_id}: SKIPPED: {_short(self.problem, 400)}"
        verdict = f"BROKEN: {_short(self.problem, 400)}" if self.problem else "ok"
        text = f"{self.task_id}: oracle {g(self.oracle)}, do-nothing {g(self.nop)} -> {verdict}"
        for name, tail in (("solution", self.solution_output), ("tests", self.test_output)):
            if tail and self.broken:
                text += f"\n    {name} output ends:\n" + "\n".join(f"      | {ln}" for ln in tail.splitlines())
        return text

    def to_json(self) -> dict[str, Any]:
        """The row of `tools/check_tasks --json`: task, built, oracle, noop, verdict, cause."""
        score = lambda g: None if g is None else g.score  # noqa: E731
        return {"task": self.task_id, "built": self.built, "oracle": score(self.oracle), "noop": score(self.nop),
                "verdict": self.verdict, "cause": self.problem}  # fmt: skip


def skipped_report(skipped: SkippedTask) -> OracleReport:
    return OracleReport(skipped.name, None, None, problem=skipped.cause, verdict="skipped")


def _short(text: str, n: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def tail_lines(text: str, n: int = TAIL_LINES) -> str:
    lines = [ln.rstrip() for ln in text.strip().splitlines()]
    return "\n".join(ln[:300] for ln in lines[-n:])


def name_cause(log: str) -> str:
    """What a test or solution log says went wrong, when it says so recognisably; else ''. A test log where
    pytest reported its results is not blamed on a missing network or pytest: a test script's setup (apt-get,
    the uv installer) fails offline before tests that then run from what was prepared at build time."""
    tests_ran = _PYTEST_SUMMARY.search(log) is not None
    for pattern, words in _LOG_CAUSES:
        if tests_ran and pattern not in _CAUSES_WHILE_TESTS_RUN:
            continue
        m = pattern.search(log)
        if m:
            return words.format(*m.groups())
    return ""


def _run_in_sandbox(sandbox: Sandbox, job: SandboxJob, timeout: float) -> tuple[int | None, str]:
    """(exit code or None on timeout, stdout and stderr together) of `job` in a fresh sandbox."""
    cwd = "/" if sandbox.isolated else job.cwd
    proc = subprocess.Popen(sandbox.command(job), cwd=cwd, env=host_env(sandbox, job), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return code, out.decode(errors="replace")


def _workspace_mounts(task: Task, sandbox: Sandbox, workspace: Path) -> tuple[list[Mount], str]:
    ws = Mount(workspace, WORKSPACE, writable=True)
    mounts, cwd = [*code_mounts(), ws], place(sandbox, ws)
    if task.workdir and sandbox.isolated:
        mounts.append(Mount(workspace, task.workdir, writable=True))
        cwd = task.workdir
    return mounts, cwd


def solve(task: Task, workspace: Path, sandbox: Sandbox) -> tuple[str, str]:
    """Run a Harbor task's solution/solve.sh on `workspace` like an agent: ('' or what went wrong, its output)."""
    solution = Path(task.source_path) / "solution"
    if not (solution / "solve.sh").is_file():
        return f"no {solution / 'solve.sh'}", ""
    mounts, cwd = _workspace_mounts(task, sandbox, workspace)
    mounts.append(Mount(solution, SOLUTION_DIR))
    script = f"{SOLUTION_DIR if sandbox.isolated else solution}/solve.sh"
    job = SandboxJob(argv=["bash", script], cwd=cwd, mounts=mounts, image=task.image,
                     overlay=agent_overlay(task, sandbox, workspace))  # fmt: skip
    timeout = task.agent_timeout_s or DEFAULT_SOLVE_TIMEOUT_S
    try:
        code, out = _run_in_sandbox(sandbox, job, timeout)
    finally:
        if job.overlay is not None:
            job.overlay.release()
    if code is None:
        return f"solve.sh ran past the task's agent timeout ({timeout:g}s)", out
    if code != 0:
        cause = name_cause(out)
        return f"solve.sh exited {code}" + (f": the solution {cause}" if cause else ""), out
    return "", out


def reference_patch(task: Task) -> str:
    """A SWE-bench instance's `patch`, read from its line of the JSONL file (it never travels with the task)."""
    path, _, line = task.source_path.rpartition(":")
    row = json.loads(Path(path).read_text().splitlines()[int(line) - 1])
    return row.get("patch") or ""


def apply_patch(workspace: Path, patch: str) -> str:
    if not patch:
        return "the instance has no patch"
    proc = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=workspace, input=patch, text=True,
                          capture_output=True, env={**os.environ, **GIT_ENV})  # fmt: skip
    return "" if proc.returncode == 0 else f"patch does not apply: {proc.stderr.strip()}"


def test_output(task: Task, workspace: Path, sandbox: Sandbox, timeout: float) -> str:
    """The tests' own output on a copy of `workspace`, run as grading runs them (what a grade does not keep)."""
    scratch = Path(tempfile.mkdtemp(prefix="gyre-diagnose-"))
    try:
        copy = scratch / "workspace"
        shutil.copytree(workspace, copy, symlinks=True)
        mounts, cwd = _workspace_mounts(task, sandbox, copy)
        env: dict[str, str] = {}
        if task.checker == "harbor":
            logs = scratch / "logs"
            for sub in ("verifier", "agent", "artifacts"):
                (logs / sub).mkdir(parents=True)
            mounts += [*tests_mounts(task, scratch, writable=sandbox.isolated), Mount(logs, LOGS_DIR, writable=True)]
            mounts += offline_test_mounts(task, scratch) if sandbox.isolated else []
            argv, env = (
                ["bash", f"{TESTS_DIR}/{task.grading.get('test_script', 'test.sh')}"],
                task.grading.get("env", {}),
            )
        elif task.checker == "swebench":
            reset_and_patch(copy, task.grading["reset_files"], task.grading["test_patch"])
            argv = list(task.grading["test_cmd"])  # in the working directory grading runs them in
        else:
            return ""
        overlay = grading_overlay(task, sandbox, workspace, scratch, [m.target for m in mounts])
        job = SandboxJob(argv=argv, cwd=cwd, env=env, mounts=mounts, image=task.image, overlay=overlay)
        try:
            code, out = _run_in_sandbox(sandbox, job, timeout)
        finally:
            if overlay is not None:
                overlay.release()
        if task.checker == "harbor":  # what the tests wrote beside the reward (pytest logs, ctrf)
            for log in sorted((scratch / "logs" / "verifier").glob("*.txt")):
                out += f"\n[{LOGS_DIR}/verifier/{log.name}]\n{log.read_text(errors='replace')}"
        return out + ("\n[the tests ran past their time]" if code is None else "")
    except (OSError, SystemExit, KeyError) as e:  # SystemExit: reset_and_patch on a test patch that does not apply
        return f"(the tests could not be run to show their output: {type(e).__name__}: {e})"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def failed_checks(grade: Grade, n: int = 3) -> str:
    """The first checks a grade failed, as 'name (detail)': which tests the oracle did not pass, and how."""
    failed = [f"{c.get('name')} ({c.get('detail', '')})" for c in grade.checks if not c.get("passed")]
    more = f" and {len(failed) - n} more" if len(failed) > n else ""
    return ", ".join(failed[:n]) + more


def _why_tests_failed(said: str, oracle: Grade) -> str:
    if said:
        return f"the test run {said}"
    failed = failed_checks(oracle)
    return "wrong answer (the tests ran and failed the reference solution" + (f": {failed})" if failed else ")")


def _causes(oracle: Grade, nop: Grade, solve_problem: str, tests_log: str) -> list[str]:
    causes = [solve_problem] if solve_problem else []
    said = name_cause(tests_log)
    if oracle.score is None:  # what the grade's own output says first (the reward guard acts only there)
        said = name_cause(oracle.reason) or said
        causes.append("the oracle's grade failed: " + (f"the test run {said} ({_short(oracle.reason)})" if said
                                                         else oracle.reason))  # fmt: skip
    elif oracle.status == "agent_failed" and not solve_problem:  # e.g. its tests wrote no reward file
        said = name_cause(oracle.reason) or said
        causes.append(
            f"the oracle gets 0, not the full reward 1: {oracle.reason}" + (f"; the test run {said}" if said else "")
        )
    elif oracle.score != 1.0 and not solve_problem:
        causes.append(
            f"the oracle gets {oracle.score:g}, not the full reward 1: {_why_tests_failed(said, oracle)}"
            + "".join(f"; {c['detail']}" for c in oracle.checks if c.get("name") == "network")
        )
    elif oracle.score != 1.0:
        causes.append(f"the oracle gets {oracle.score:g}, not the full reward 1")
    if nop.score is None:
        causes.append(f"the do-nothing agent's grade failed: {nop.reason}")
    elif nop.score >= 1.0:
        causes.append("the do-nothing agent gets the full reward")
    return causes


# A losing agent's conftest.py in every directory of its workspace: where a task's tests run pytest on files there
# (copied in beside the agent's work, or collected from it), pytest loads it, and it passes every test
PLANTED_CONFTEST = (
    "import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
    "    (yield).get_result().outcome = 'passed'\n"
)
FORGEABLE = ("forgeable: a conftest.py the agent leaves in its working directory gets the full reward (the tests run "
             "pytest on files there, where the agent's code decides their outcome)")  # fmt: skip


def plant_conftest(workspace: Path) -> Path:
    """`workspace` with PLANTED_CONFTEST in it and in each of its directories (but .git)."""
    dirs = [d for d in workspace.rglob("*") if d.is_dir() and not d.is_symlink() and ".git" not in d.parts]
    for d in [workspace, *dirs]:
        (d / "conftest.py").write_text(PLANTED_CONFTEST)
    return workspace


def check_task(
    task: Task, sandbox: Sandbox, check_timeout_s: float = 60.0, build: EnvironmentBuilder = no_build
) -> OracleReport:
    built = build(task)
    if built.built is False:
        return OracleReport(task.task_id, None, None, problem=f"environment not built: {built.cause}",
                            verdict="skipped", built=False)  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="gyre-oracle-"))
    try:
        nop = grade_workspace(task, task.materialize(root / "nop"), check_timeout_s=check_timeout_s, sandbox=sandbox)
        workspace = task.materialize(root / "oracle")
        solve_out = ""
        if task.checker == "harbor":
            why, solve_out = solve(task, workspace, sandbox)
        elif task.checker == "swebench":
            why = apply_patch(workspace, reference_patch(task))
        else:
            why = f"no oracle for checker {task.checker!r}"
        oracle = grade_workspace(task, workspace, check_timeout_s=check_timeout_s, sandbox=sandbox)
        sound = not why and oracle.score == 1.0 and nop.score is not None and nop.score < 1.0
        tests_log = "" if sound else test_output(task, workspace, sandbox, task.check_timeout_s or check_timeout_s)
        forged = None
        if sound and task.checker == "harbor":  # SWE-bench's checker puts the original conftest.py files back
            planted = plant_conftest(task.materialize(root / "planted"))
            forged = grade_workspace(task, planted, check_timeout_s=check_timeout_s, sandbox=sandbox)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    causes = _causes(oracle, nop, why, tests_log)
    if forged is not None and forged.score is not None and forged.score >= 1.0:
        causes.append(FORGEABLE)
    return OracleReport(
        task.task_id, oracle, nop, problem="; ".join(causes), verdict="broken" if causes else "sound",
        built=built.built, test_output=tail_lines(tests_log) if causes else "",
        solution_output=tail_lines(solve_out) if why else "", causes=causes,
    )  # fmt: skip
