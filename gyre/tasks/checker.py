"""The built-in checker: evaluates check specs against a workspace. Standard library only.

Run as a script by grading (`python -I checker.py spec.json`, spec = {"workspace", "checks",
"python_timeout_s", "python_budget_s"}); it prints {"results": [...]} as its last stdout line. The built-in harness
imports `run_checks` for its visible self-check. Python files written by the agent run in their
own subprocess, so a file that hangs or crashes fails its check instead of breaking the checker.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gyre.tasks.agent_code import agent_code_starts

MAX_READ_BYTES = 1 << 20  # a checked file is read at most this far, so a huge one cannot stall grading

_DUMP_GLOBALS = (
    "import json, runpy, sys\n"
    "g = runpy.run_path(sys.argv[1], run_name='__main__')\n"
    "simple = {k: v for k, v in g.items() if not k.startswith('_') and isinstance(v, (bool, int, float, str))}\n"
    "print('\\n' + json.dumps(simple))\n"
)


def run_python_file(path: Path, timeout_s: float) -> tuple[dict[str, Any] | None, str]:
    """Run a Python file in an isolated interpreter; (its simple globals, "") or (None, why it failed).

    Bounded by `timeout_s` however the file behaves: a child it leaves behind holding our pipes
    (forked, even into a session of its own) costs at most a second more, never a hung checker.
    """
    agent_code_starts()
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _DUMP_GLOBALS, str(path)],
        cwd=path.parent,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # stays in our process group, so whoever kills the checker's group kills it too
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            proc.communicate(timeout=1.0)
        except subprocess.TimeoutExpired:  # a descendant still holds the pipes: leave it to the group's sweep
            pass
        return None, f"timed out after {timeout_s:g}s"
    if proc.returncode != 0:
        lines = err.strip().splitlines()
        return None, lines[-1] if lines else f"exit code {proc.returncode}"
    try:
        return json.loads(out.strip().splitlines()[-1]), ""
    except (json.JSONDecodeError, IndexError):
        return None, "could not read its globals"


def _read(workspace: Path, rel: str) -> str | None:
    """The file's text; None when missing or larger than any file a check compares (MAX_READ_BYTES)."""
    path = workspace / rel
    if not path.is_file():
        return None
    with path.open("rb") as f:
        data = f.read(MAX_READ_BYTES + 1)
    return None if len(data) > MAX_READ_BYTES else data.decode(errors="replace")


def _assigns(var: str) -> re.Pattern[str]:
    return re.compile(rf"^\s*{re.escape(var)}\s*=")


class _Checks:
    """Check kinds; `python` caches one run per file so several checks on it cost one subprocess."""

    def __init__(self, workspace: Path, python_timeout_s: float, python_budget_s: float | None) -> None:
        self.workspace = workspace
        self.python_timeout_s = python_timeout_s
        self._deadline = None if python_budget_s is None else time.monotonic() + python_budget_s
        self._python: dict[str, tuple[dict[str, Any] | None, str]] = {}

    def python(self, rel: str) -> tuple[dict[str, Any] | None, str]:
        if rel not in self._python:
            path = self.workspace / rel
            timeout_s = self.python_timeout_s
            if self._deadline is not None:
                timeout_s = min(timeout_s, self._deadline - time.monotonic())
            if not path.is_file():
                self._python[rel] = (None, "missing")
            elif timeout_s <= 0:
                self._python[rel] = (None, "not run: the workspace's programs used up the checker's time")
            else:
                self._python[rel] = run_python_file(path, timeout_s)
        return self._python[rel]

    def file_exists(self, path: str) -> tuple[bool, str]:
        return (self.workspace / path).is_file(), ""

    def file_equals(self, path: str, value: str) -> tuple[bool, str]:
        text = _read(self.workspace, path)
        if text is None:
            return False, "missing"
        return text.strip() == value, "" if text.strip() == value else f"got {text.strip()[:40]!r}"

    def python_runs(self, path: str) -> tuple[bool, str]:
        values, why = self.python(path)
        return values is not None, why

    def python_value(self, path: str, var: str, value: Any) -> tuple[bool, str]:
        values, why = self.python(path)
        if values is None:
            return False, why
        got = values.get(var)
        ok = got == value and type(got) is type(value)
        return ok, "" if ok else f"{var} is {got!r}"

    def lines_kept(self, path: str, var: str, lines: list[str]) -> tuple[bool, str]:
        """The file's non-blank lines, except those assigning `var`, are exactly `lines`."""
        text = _read(self.workspace, path)
        if text is None:
            return False, "missing"
        pattern = _assigns(var)
        kept = [ln.rstrip() for ln in text.splitlines() if ln.strip() and not pattern.match(ln)]
        return kept == lines, "" if kept == lines else "other lines changed"


CHECK_KINDS = ("file_exists", "file_equals", "python_runs", "python_value", "lines_kept")


def run_checks(
    checks: list[dict[str, Any]],
    workspace: str | Path,
    python_timeout_s: float = 5.0,
    python_budget_s: float | None = None,
) -> list[dict[str, Any]]:
    """Evaluate each check spec; an unknown kind or bad params raises (a broken evaluation, not a fail).

    The workspace's programs run for `python_timeout_s` each and `python_budget_s` in all, so the
    checker ends within its own time limit whatever they do: a checker that times out is then a
    broken evaluation, never something an agent can cause to have its rollout excluded.

    A spec may name an earlier check in "requires": it then passes only if that one passed too, so
    collateral checks ("other lines unchanged") give no credit to an agent that did nothing.
    """
    impl = _Checks(Path(workspace), python_timeout_s, python_budget_s)
    results: list[dict[str, Any]] = []
    passed_by_name: dict[str, bool] = {}
    for spec in checks:
        kind, name, requires = spec["kind"], spec["name"], spec.get("requires")
        if kind not in CHECK_KINDS:
            raise ValueError(f"unknown check kind {kind!r} in check {name!r}; known: {CHECK_KINDS}")
        if requires is not None and requires not in passed_by_name:
            raise ValueError(f"check {name!r} requires {requires!r}, which is not an earlier check")
        if requires is not None and not passed_by_name[requires]:
            passed, detail = False, f"needs {requires}"
        else:
            params = {k: v for k, v in spec.items() if k not in ("name", "kind", "requires")}
            passed, detail = getattr(impl, kind)(**params)
        passed_by_name[name] = bool(passed)
        results.append({"name": name, "passed": bool(passed), "detail": detail})
    return results


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -I checker.py SPEC.json")
    spec = json.loads(Path(argv[0]).read_text())
    results = run_checks(
        spec["checks"], spec["workspace"], spec.get("python_timeout_s", 5.0), spec.get("python_budget_s")
    )
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main(sys.argv[1:])
