"""SWE-bench grading, run as the checker of a SWE-bench instance in its grading sandbox. Standard library only.

spec = {"workspace", "reset_files", "test_patch", "test_cmd", "log_parser", "FAIL_TO_PASS", "PASS_TO_PASS",
"tests_timeout_s", "pid_namespace"}.
As SWE-bench's evaluation does, on the copy of the final workspace: put the files the test patch
touches back to base_commit (`reset_files`: path -> base64 content, null where the file did not exist),
apply `test_patch` (git apply, with a git directory of our own: the agent's .git is never read), run
`test_cmd`, parse its log into a status per test and grade it with SWE-bench's rules: a FAIL_TO_PASS
test must pass (PASSED or XFAIL; skipped or missing is a failure), a PASS_TO_PASS test must pass or be
skipped. The score is the fraction of FAIL_TO_PASS tests passed when every PASS_TO_PASS test holds, else
0. A log that reports no failure although the test command failed is not believed (all tests fail), nor
is one of tests that ran past their time, died of a signal or left a process behind (score 0, the
agent's failure: gyre.tasks.agent_code).
A test patch that does not apply to the reset files is a broken task: this script exits non-zero.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gyre.tasks.agent_code import evaluation_broken, run_tests

PASSING, MAINTAINED = {"PASSED", "XFAIL"}, {"PASSED", "XFAIL", "SKIPPED"}
_UNITTEST = re.compile(
    r"^(\w+) \(([\w.]+)\)(?: .*)? \.\.\. (ok|FAIL|ERROR|skipped|expected failure|unexpected success)"
)
_UNITTEST_STATUS = {"ok": "PASSED", "FAIL": "FAILED", "ERROR": "ERROR", "skipped": "SKIPPED",
                    "expected failure": "XFAIL", "unexpected success": "FAILED"}  # fmt: skip
_PYTEST_STATUSES = ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL")


def parse_unittest(log: str) -> dict[str, str]:
    """`python -m unittest -v` lines `test_x (pkg.mod.Class.test_x) ... ok` (older Pythons: `(pkg.mod.Class)`)."""
    status: dict[str, str] = {}
    for line in log.splitlines():
        m = _UNITTEST.match(line.strip())
        if m:
            name, where, word = m.groups()
            test_id = where if where.endswith("." + name) else f"{where}.{name}"
            status[test_id] = _UNITTEST_STATUS[word]
    return status


def parse_pytest(log: str) -> dict[str, str]:
    """`pytest -rA` summary lines `PASSED tests/test_x.py::test_y` (SWE-bench's parse_log_pytest)."""
    status: dict[str, str] = {}
    for line in log.splitlines():
        words = line.strip().split()
        if len(words) > 1 and words[0] in _PYTEST_STATUSES:
            status[words[1]] = words[0]
    return status


PARSERS = {"unittest": parse_unittest, "pytest": parse_pytest}


def _real_parents(workspace: Path, rel: str) -> None:
    """Every directory above `rel` a real one inside the workspace: the agent may have put a link or a file
    there, and writing through it (or git refusing to) would break grading, which is not the agent's to do."""
    path = workspace
    for part in Path(rel).parts[:-1]:
        path = path / part
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            path.unlink()
        path.mkdir(exist_ok=True)


def reset_and_patch(workspace: Path, reset_files: dict[str, str | None], test_patch: str) -> None:
    for rel, content in reset_files.items():
        _real_parents(workspace, rel)
        path = workspace / rel
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        if content is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(base64.b64decode(content))
    with tempfile.TemporaryDirectory() as git_dir:
        base = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
        subprocess.run(["git", "init", "-q", "--bare", git_dir], env=base, check=True, capture_output=True)
        env = {**base, "GIT_DIR": git_dir, "GIT_WORK_TREE": str(workspace)}
        proc = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=workspace, env=env,
                              input=test_patch, text=True, capture_output=True)  # fmt: skip
    if proc.returncode != 0:
        evaluation_broken(f"test_patch does not apply to the reset test files: {proc.stderr.strip()}")


def report(status: dict[str, str], fail_to_pass: list[str], pass_to_pass: list[str]) -> dict[str, Any]:
    results = [{"name": f"FAIL_TO_PASS: {t}", "passed": status.get(t) in PASSING, "detail": status.get(t, "missing")}
               for t in fail_to_pass]  # fmt: skip
    results += [{"name": f"PASS_TO_PASS: {t}", "passed": status.get(t) in MAINTAINED,
                 "detail": status.get(t, "missing")} for t in pass_to_pass]  # fmt: skip
    f2p = sum(status.get(t) in PASSING for t in fail_to_pass) / len(fail_to_pass) if fail_to_pass else 1.0
    p2p_held = all(status.get(t) in MAINTAINED for t in pass_to_pass)
    return {"results": results, "score": f2p if p2p_held else 0.0}


def main(argv: list[str]) -> None:
    spec = json.loads(Path(argv[0]).read_text())
    workspace = Path(spec["workspace"])
    reset_and_patch(workspace, spec["reset_files"], spec["test_patch"])
    with tempfile.TemporaryFile() as log:  # a file, not a pipe a process of the agent's could hold open
        run = run_tests(spec["test_cmd"], cwd=str(workspace), env=None, timeout_s=spec["tests_timeout_s"], out=log,
                        pid_namespace=spec["pid_namespace"])  # fmt: skip
        log.seek(0)
        text = log.read().decode(errors="replace")
    failure = run.agent_failure()
    status = {} if failure else PARSERS[spec["log_parser"]](text)  # a failed run: every test fails
    if run.returncode != 0 and not any(s in ("FAILED", "ERROR") for s in status.values()):
        status = {}  # the log does not describe the run that happened (SWE-bench's exit-code cross-check)
    print(json.dumps({**report(status, spec["FAIL_TO_PASS"], spec["PASS_TO_PASS"]), "agent_failed": failure}))


if __name__ == "__main__":
    main(sys.argv[1:])
