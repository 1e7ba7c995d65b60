"""The test runners' own record of a run, read by gyre.tasks.swebench_checker and harbor_checker. Standard library only.

Grading reads results from here, never from lines the code under test can print. Each runner process
(pytest through `-p gyre_test_report`, unittest's TextTestRunner through sitecustomize) creates its record
in GYRE_TEST_REPORT_DIR when its run starts, marked incomplete, and fills it in when the run ends: a run
that ends early (os._exit, a crash, a kill) leaves an incomplete record, which scores 0. Code running in
the runner's own process can still rewrite a record: that is beyond what a process boundary we do not
have can guard.

A Harbor task's tests run programs of their own choosing: there, each Python process that loads the
agent's code (a file under GYRE_AGENT_CODE_DIRS opened as code) reports on GYRE_EXIT_REPORT_FD, a pipe
to the checker, any os._exit it calls from then on: leaving with status 0 before a runner has run a test.
What is written on that pipe cannot be taken back.

PYTEST_DONT_REWRITE: sitecustomize imports this module before pytest loads it as a plugin, and pytest's warning
about a module it cannot rewrite is an error under a repository's `filterwarnings = error` (Flask's).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

CODE_SUFFIXES = (".py", ".pyc", ".pyw", ".so")

_status: dict[str, str] = {}


class Record:
    """One runner's record file, created (never reused) when its run starts."""

    def __init__(self, runner: str) -> None:
        directory = os.environ["GYRE_TEST_REPORT_DIR"]
        path = os.path.join(directory, f"{runner}-{os.getpid()}-{len(os.listdir(directory))}.json")
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self.runner = runner
        os.write(self.fd, json.dumps({"runner": runner, "complete": False}).encode())

    def finish(self, status: dict[str, str]) -> None:
        data = json.dumps({"runner": self.runner, "complete": True, "status": status}).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        os.close(self.fd)


def _set(test_id: str, status: str) -> None:
    if _status.get(test_id) not in ("FAILED", "ERROR"):  # a failed subtest or teardown is not undone by a pass
        _status[test_id] = status


def hook_unittest() -> None:
    """Record each outcome of unittest.TestResult, and a record per TextTestRunner.run."""
    import unittest

    outcomes = {"addSuccess": "PASSED", "addFailure": "FAILED", "addError": "ERROR", "addSkip": "SKIPPED",
                "addExpectedFailure": "XFAIL", "addUnexpectedSuccess": "FAILED"}  # fmt: skip
    for method, status in outcomes.items():
        original = getattr(unittest.TestResult, method)

        def recorded(self: Any, test: Any, *args: Any, _original: Any = original, _status: str = status) -> Any:
            _set(test.id(), _status)
            return _original(self, test, *args)

        setattr(unittest.TestResult, method, recorded)
    add_subtest = unittest.TestResult.addSubTest

    def sub_test(self: Any, test: Any, subtest: Any, err: Any) -> Any:
        if err is not None:
            _set(test.id(), "FAILED")
        return add_subtest(self, test, subtest, err)

    unittest.TestResult.addSubTest = sub_test  # type: ignore[method-assign]
    run = unittest.TextTestRunner.run

    def recorded_run(self: Any, test: Any) -> Any:
        record = Record("unittest")
        _status.clear()
        result = run(self, test)
        record.finish(dict(_status))
        return result

    unittest.TextTestRunner.run = recorded_run  # type: ignore[method-assign]


def watch_agent_code(dirs: Sequence[str], report_fd: int) -> None:
    """From the first file of `dirs` this process opens as code on, report its own os._exit on `report_fd`."""
    prefixes = tuple(d.rstrip("/") + "/" for d in dirs if d)
    watched: list[int] = []

    def on_event(event: str, args: tuple[Any, ...]) -> None:
        if watched or event != "open" or not isinstance(args[0], str) or not args[0].endswith(CODE_SUFFIXES):
            return
        if os.path.join(os.getcwd(), args[0]).startswith(prefixes):
            watched.append(os.getpid())
            _report_exits(report_fd, os.getpid())

    sys.addaudithook(on_event)


def _report_exits(report_fd: int, pid: int) -> None:
    import posix

    real_exit = posix._exit

    def reported_exit(code: int) -> None:
        if os.getpid() == pid:  # not a forked child (multiprocessing's end with os._exit): the process itself
            try:
                os.write(report_fd, f"os._exit {code} pid {pid}\n".encode())
            except OSError:
                pass
        real_exit(code)

    os._exit = posix._exit = reported_exit  # type: ignore[assignment]


# pytest plugin hooks (`-p gyre_test_report`)
_pytest_record: Record | None = None


def pytest_configure(config: Any) -> None:
    global _pytest_record
    if _pytest_record is None and not hasattr(config, "workerinput"):  # one record per session, none per worker
        _pytest_record = Record("pytest")


def pytest_runtest_logreport(report: Any) -> None:
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            _set(report.nodeid, "XFAIL" if report.skipped else "PASSED")
        else:
            _set(report.nodeid, {"passed": "PASSED", "failed": "FAILED", "skipped": "SKIPPED"}[report.outcome])
    elif report.failed:  # setup or teardown
        _set(report.nodeid, "ERROR")
    elif report.skipped and report.when == "setup":
        _set(report.nodeid, "XFAIL" if hasattr(report, "wasxfail") else "SKIPPED")


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if _pytest_record is not None:
        _pytest_record.finish(dict(_status))
