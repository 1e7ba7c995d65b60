"""SWE-bench grading, run as the checker of a SWE-bench instance in its grading sandbox. Standard library only.

spec = {"workspace", "reset_files", "test_patch", "test_cmd", "log_parser", "FAIL_TO_PASS", "PASS_TO_PASS",
"tests_timeout_s", "pid_namespace", "original_files", "runner_files"}.
As SWE-bench's evaluation does, on the copy of the final workspace: put the files the test patch
touches back to base_commit (`reset_files`: path -> base64 content, null where the file did not exist),
apply `test_patch` (git apply, with a git directory of our own: the agent's .git is never read), run
`test_cmd`, take a status per test and grade it with SWE-bench's rules: a FAIL_TO_PASS test must pass
(PASSED or XFAIL; skipped or missing is a failure), a PASS_TO_PASS test must pass or be skipped. The
score is the fraction of FAIL_TO_PASS tests passed when every PASS_TO_PASS test holds, else 0.

What the code under test cannot steer:
- files the runner or the interpreter loads on their own are the original ones: conftest.py and the
  runner's configuration files are restored (`runner_files`) or removed when the agent added them, and so
  are sitecustomize/usercustomize and *.pth files, and distributions' metadata (*.dist-info, *.egg-info,
  entry_points.txt: pytest loads each pytest11 entry point as a plugin); compiled files (*.pyc,
  __pycache__) are removed, and so are modules the agent added that shadow the standard library or the
  test runner (`original_files` says what the tree held);
- the tests run with PYTHONSAFEPATH (the workspace after the standard library: runner_hooks/sitecustomize.py);
- the statuses come from the runners' own records (runner_hooks/gyre_test_report.py), never from lines
  the code can print; a run without a complete record (os._exit, a crash) scores 0 as the agent's failure,
  and so does one of tests that ran past their time, died of a signal or left a process behind
  (gyre.tasks.agent_code). A record without a failure although the test command failed is not believed
  (all tests fail: SWE-bench's exit-code cross-check).
A test patch that does not apply to the reset files is a broken task: this script ends as an evaluation error.
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

from gyre.tasks import agent_code
from gyre.tasks.agent_code import evaluation_broken, run_tests
from gyre.tasks.runner_hooks.runner_imports import RUNNER

RUNNER_HOOKS = Path(agent_code.__file__).with_name("runner_hooks")  # sitecustomize.py, gyre_test_report.py
# Files a test runner reads on its own, wherever they are: the original's content, or gone
RUNNER_CONFIG = frozenset({"conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml",
                           "sitecustomize.py", "usercustomize.py", "entry_points.txt"})  # fmt: skip
# Installed distributions' metadata, which importlib.metadata finds in each directory on the import path (the
# workspace's too): pytest loads every pytest11 entry point of them as a plugin
METADATA_SUFFIXES = (".dist-info", ".egg-info")
RUNNER_MODULES = RUNNER | {"unittest"}  # pytest and what it imports of its own accord, unittest, our hooks
MODULE_SUFFIXES = (".py", ".pyc", ".pyw", ".so", ".pyd")

PASSING, MAINTAINED = {"PASSED", "XFAIL"}, {"PASSED", "XFAIL", "SKIPPED"}
_UNITTEST = re.compile(
    r"^(\w+) \(([\w.]+)\)(?: .*)? \.\.\. (ok|FAIL|ERROR|skipped|expected failure|unexpected success)"
)
_UNITTEST_STATUS = {"ok": "PASSED", "FAIL": "FAILED", "ERROR": "ERROR", "skipped": "SKIPPED",
                    "expected failure": "XFAIL", "unexpected success": "FAILED"}  # fmt: skip
_SETS_PYTHONPATH = re.compile(r"(?<![\w$])PYTHONPATH=(\"[^\"]*\"|'[^']*'|[^\s;&|]*)")
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


PARSERS = {"unittest": parse_unittest, "pytest": parse_pytest}  # SWE-bench's log formats, for reading a log by eye


def is_runner_file(rel: str) -> bool:
    name = Path(rel).name
    return name in RUNNER_CONFIG or name.endswith(".pth")


def runner_files(files: dict[str, str]) -> dict[str, str]:
    """The original runner files of a task's tree (path -> base64 content), to restore before the tests run."""
    return {rel: base64.b64encode(text.encode()).decode() for rel, text in files.items() if is_runner_file(rel)}


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _shadows(name: str) -> bool:
    """A module or package name that would stand in for the standard library's or the test runner's."""
    module = name.split(".", 1)[0] if name.endswith(MODULE_SUFFIXES) else name
    return module in sys.stdlib_module_names or module in RUNNER_MODULES


def refuse_loaded_files(workspace: Path, original: set[str], restore: dict[str, str], test_dirs: set[str]) -> list[str]:
    """Remove what the interpreter or the runner would load on its own that the original tree did not hold, then
    put the original runner files back; the paths removed."""
    removed: list[str] = []
    original_dirs = {str(parent) for rel in original for parent in Path(rel).parents}
    for root, dirs, names in os.walk(workspace):
        here = Path(root)
        rel_root = here.relative_to(workspace)
        for name in [*dirs, *names]:
            rel = str(rel_root / name)
            compiled = name == "__pycache__" or name.endswith((".pyc", ".pyo"))
            added = rel not in original and rel not in original_dirs
            shadow = str(rel_root) in test_dirs and _shadows(name)
            metadata = added and name.endswith(METADATA_SUFFIXES)
            if compiled or metadata or (is_runner_file(rel) and rel not in restore) or (added and shadow):
                _remove(here / name)
                removed.append(rel)
        dirs[:] = [d for d in dirs if (here / d).is_dir() and not (here / d).is_symlink()]
    for rel, content in restore.items():
        _real_parents(workspace, rel)
        path = workspace / rel
        if path.is_symlink() or path.exists():
            _remove(path)
        path.write_bytes(base64.b64decode(content))
    return removed


def tests_env(workspace: Path, report_dir: Path) -> dict[str, str]:
    """The tests' environment: isolated import path, the runners' records switched on."""
    addopts = " ".join(filter(None, [os.environ.get("PYTEST_ADDOPTS"), "-p gyre_test_report"]))
    return {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": str(RUNNER_HOOKS), "PYTHONNOUSERSITE": "1",
            "GYRE_TEST_WORKSPACE": str(workspace), "GYRE_TEST_REPORT_DIR": str(report_dir),
            "PYTEST_ADDOPTS": addopts}  # fmt: skip


def _record(path: Path) -> dict[str, Any]:
    """One runner's record; an unreadable one reads as incomplete."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"runner": "?", "complete": False}
    if not isinstance(record, dict) or not isinstance(record.get("status", {}), dict):
        return {"runner": "?", "complete": False}
    return record


def read_records(report_dir: Path, runner: str) -> tuple[dict[str, str], str | None]:
    """(status per test, None) from the runners' complete records, or ({}, the agent failure) without one.
    Where records disagree on a test, a failing status wins: a record added beside the runner's own (the code
    under test can write files too) cannot turn its failures into passes."""
    records = [_record(p) for p in sorted(report_dir.glob("*.json"))]
    ours = [r for r in records if r.get("runner") == runner]
    if not ours:
        return {}, f"tests_incomplete: no {runner} run left its record (the tests ended before running any)"
    if not all(r.get("complete") is True for r in records):
        return {}, f"tests_incomplete: a {runner} run ended without completing its record"
    status: dict[str, str] = {}
    for r in ours:
        for test, outcome in r.get("status", {}).items():
            for name in {str(test), published_id(str(test))}:
                if status.get(name) not in ("FAILED", "ERROR"):
                    status[name] = str(outcome)
    return status, None


def published_id(test: str) -> str:
    """A test id as SWE-bench's lists name it: its log parser keeps the first word after the status, so a
    parametrized id with a space (`test_locate_app[cliapp.factory-create_app2("foo", "bar")]`) is cut there."""
    words = test.split()
    return words[0] if words else test


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


def with_hooks(test_cmd: list[str]) -> list[str]:
    """The test command (an argv) with the runners' hooks still on the import path where it sets PYTHONPATH
    itself (SWE-bench's `PYTHONPATH=src python3 -m pytest ...`, run as `bash -c`): a runner without its record
    scores 0."""
    return [_SETS_PYTHONPATH.sub(lambda m: f"{m.group(0)}:{RUNNER_HOOKS}", arg) for arg in test_cmd]


def run_and_read(spec: dict[str, Any], workspace: Path) -> tuple[dict[str, str], str | None]:
    """(status per test, the agent failure or None) of the test command over `workspace`, run where the
    environment has the repository (`workdir`: an image's /testbed, where its editable install points; the
    same directory as `workspace`), so that paths the code under test computes agree with the tests'."""
    workspace = Path(spec.get("workdir") or workspace)
    with tempfile.TemporaryDirectory(prefix="gyre-test-report-") as report_dir, open(os.devnull, "wb") as out:
        run = run_tests(with_hooks(spec["test_cmd"]), cwd=str(workspace), env=tests_env(workspace, Path(report_dir)),
                        timeout_s=spec["tests_timeout_s"], out=out, pid_namespace=spec["pid_namespace"])  # fmt: skip
        failure = run.agent_failure()
        status, failure = ({}, failure) if failure else read_records(Path(report_dir), spec["log_parser"])
    if run.returncode != 0 and not any(s in ("FAILED", "ERROR") for s in status.values()):
        status = {}  # the record does not describe the run that happened (SWE-bench's exit-code cross-check)
    return status, failure


def main(argv: list[str]) -> None:
    spec = json.loads(Path(argv[0]).read_text())
    workspace = Path(spec["workspace"])
    reset_and_patch(workspace, spec["reset_files"], spec["test_patch"])
    test_dirs = {"."} | {str(Path(rel).parent) for rel in spec["reset_files"]}
    refuse_loaded_files(workspace, set(spec["original_files"]), spec["runner_files"], test_dirs)
    status, failure = run_and_read(spec, workspace)
    print(json.dumps({**report(status, spec["FAIL_TO_PASS"], spec["PASS_TO_PASS"]), "agent_failed": failure}))


if __name__ == "__main__":
    main(sys.argv[1:])
