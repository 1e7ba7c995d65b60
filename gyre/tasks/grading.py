"""Grading a workspace: the task's checker runs as its own process, outside the workspace.

Outcomes: "ok" (graded), "timeout" (the harness was killed at its time limit; the preserved
workspace is graded all the same), "failed" (the evaluation itself broke: the checker crashed,
hung or printed garbage, or the workspace is gone). A failed grade has score None and must be
excluded from training, never counted as a zero.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.tasks import checker
from gyre.tasks.task import Task

BUILTIN_CHECKER = Path(checker.__file__)


@dataclass(frozen=True)
class Grade:
    status: str  # "ok" | "timeout" | "failed"
    score: float | None  # fraction of checks passed; None when failed
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

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "success": self.success}


def _tail(text: str, n: int = 400) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def _parse_results(stdout: str) -> list[dict[str, Any]]:
    lines = stdout.strip().splitlines()
    if not lines:
        raise ValueError("checker printed nothing")
    results = json.loads(lines[-1])["results"]
    if not isinstance(results, list) or not results:
        raise ValueError("checker reported no results")
    for r in results:
        if not isinstance(r, dict) or not isinstance(r.get("passed"), bool) or "name" not in r:
            raise ValueError(f"malformed check result {r!r}")
    return results


def _run_checker(script: Path, spec: Path, timeout_s: float) -> tuple[int | None, str, str]:
    """(returncode or None on timeout, stdout, stderr); a timed-out checker dies with its process group."""
    proc = subprocess.Popen(
        [sys.executable, "-I", str(script), str(spec)],
        cwd=spec.parent,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    try:  # sweep anything the checker left behind in its group
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return code, out, err


def grade_workspace(
    task: Task,
    workspace: str | Path,
    *,
    timed_out: bool = False,
    check_timeout_s: float = 10.0,
    scratch_dir: str | Path | None = None,
) -> Grade:
    """Run the task's hidden checks on `workspace`. The checker script and its spec are written to
    `scratch_dir` (a temporary directory when None), never inside the workspace."""
    workspace = Path(workspace).resolve()
    if not workspace.is_dir():
        return Grade.failed(f"workspace {workspace} does not exist")
    if not task.checks and task.checker_source is None:
        return Grade.failed(f"task {task.task_id} has no checks")
    own_scratch = scratch_dir is None
    scratch = Path(tempfile.mkdtemp(prefix="gyre-grade-") if own_scratch else scratch_dir)
    try:
        scratch.mkdir(parents=True, exist_ok=True)
        script = scratch / "checker.py"
        script.write_text(task.checker_source if task.checker_source is not None else BUILTIN_CHECKER.read_text())
        spec = scratch / "spec.json"
        python_timeout_s = min(5.0, check_timeout_s / 3)
        spec.write_text(
            json.dumps({"workspace": str(workspace), "checks": task.checks, "python_timeout_s": python_timeout_s})
        )
        code, out, err = _run_checker(script, spec, check_timeout_s)
    finally:
        if own_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    if code is None:
        return Grade.failed(f"checker timed out after {check_timeout_s:g}s")
    if code != 0:
        return Grade.failed(f"checker exited with code {code}: {_tail(err) or '(no stderr)'}")
    try:
        results = _parse_results(out)
    except (ValueError, KeyError, TypeError) as e:
        return Grade.failed(f"checker output unreadable ({e}): {_tail(out, 200)!r}")
    passed = sum(r["passed"] for r in results)
    return Grade(
        status="timeout" if timed_out else "ok",
        score=passed / len(results),
        passed=passed,
        total=len(results),
        checks=results,
    )
