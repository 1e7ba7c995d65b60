"""The oracle check of a suite on disk: every task's reference solution, and a do-nothing agent, through
the real grading path (what Harbor's oracle and nop agents do for its tasks).

The reference solution of a Harbor task is solution/solve.sh, run like an agent in the task's sandbox
(the workspace writable at /workspace and the working directory, solution/ read-only at /solution,
within the task's agent timeout); of a SWE-bench instance, its `patch`, applied to the workspace. A task
is sound when the oracle gets the full reward (1) and the do-nothing agent less; anything else, or a
grade that fails, makes it broken.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gyre.sandbox import Mount, Sandbox, SandboxJob, place
from gyre.sandbox.base import WORKSPACE, code_mounts, host_env
from gyre.tasks.grading import Grade, grade_workspace
from gyre.tasks.task import GIT_ENV, Task

SOLUTION_DIR = "/solution"
DEFAULT_SOLVE_TIMEOUT_S = 600.0


@dataclass
class OracleReport:
    task_id: str
    oracle: Grade
    nop: Grade
    problem: str = ""  # empty: sound

    @property
    def broken(self) -> bool:
        return bool(self.problem)

    def line(self) -> str:
        def g(grade: Grade) -> str:
            return f"{grade.score:g}" if grade.score is not None else f"failed ({_short(grade.reason)})"

        verdict = f"BROKEN: {_short(self.problem)}" if self.problem else "ok"
        return f"{self.task_id}: oracle {g(self.oracle)}, do-nothing {g(self.nop)} -> {verdict}"


def _short(text: str, n: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def run_solve_script(task: Task, workspace: Path, sandbox: Sandbox) -> str:
    """Run a Harbor task's solution/solve.sh on `workspace` like an agent; '' or what went wrong."""
    solution = Path(task.source_path) / "solution"
    if not (solution / "solve.sh").is_file():
        return f"no {solution / 'solve.sh'}"
    ws = Mount(workspace, WORKSPACE, writable=True)
    mounts = [*code_mounts(), ws, Mount(solution, SOLUTION_DIR)]
    cwd = place(sandbox, ws)
    if task.workdir and sandbox.isolated:
        mounts.append(Mount(workspace, task.workdir, writable=True))
        cwd = task.workdir
    script = f"{SOLUTION_DIR if sandbox.isolated else solution}/solve.sh"
    job = SandboxJob(argv=["bash", script], cwd=cwd, mounts=mounts, image=task.image)
    timeout = task.agent_timeout_s or DEFAULT_SOLVE_TIMEOUT_S
    proc = subprocess.Popen(sandbox.command(job), cwd=cwd if not sandbox.isolated else "/", env=host_env(sandbox, job),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"solve.sh ran past the task's agent timeout ({timeout:g}s)"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return "" if proc.returncode == 0 else f"solve.sh exited {proc.returncode}: {out.decode(errors='replace')[-300:]}"


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


def check_task(task: Task, sandbox: Sandbox, check_timeout_s: float = 60.0) -> OracleReport:
    root = Path(tempfile.mkdtemp(prefix="gyre-oracle-"))
    try:
        nop = grade_workspace(task, task.materialize(root / "nop"), check_timeout_s=check_timeout_s, sandbox=sandbox)
        workspace = task.materialize(root / "oracle")
        if task.checker == "harbor":
            why = run_solve_script(task, workspace, sandbox)
        elif task.checker == "swebench":
            why = apply_patch(workspace, reference_patch(task))
        else:
            why = f"no oracle for checker {task.checker!r}"
        oracle = grade_workspace(task, workspace, check_timeout_s=check_timeout_s, sandbox=sandbox)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    problem = why
    if not problem and oracle.score is None:
        problem = f"the oracle's grade failed: {oracle.reason}"
    elif not problem and oracle.score != 1.0:
        problem = f"the oracle gets {oracle.score:g}, not the full reward 1"
        problem += "".join(f": {c['detail']}" for c in oracle.checks if c.get("name") == "network")
    elif not problem and nop.score is None:
        problem = f"the do-nothing agent's grade failed: {nop.reason}"
    elif not problem and nop.score is not None and nop.score >= 1.0:
        problem = "the do-nothing agent gets the full reward"
    return OracleReport(task.task_id, oracle, nop, problem)
