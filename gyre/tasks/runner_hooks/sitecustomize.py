"""Loaded by each Python process of a SWE-bench instance's tests: PYTHONPATH names this directory alone
(gyre.tasks.swebench_checker). Standard library only.

The tests run with PYTHONSAFEPATH, so neither the working directory nor a script's directory comes first
on the import path; the workspace (GYRE_TEST_WORKSPACE) goes after the standard library instead, before
the installed packages, so that nothing in it shadows the standard library. With GYRE_TEST_REPORT_DIR set,
unittest's runner records its results (gyre_test_report), importing unittest now, from the standard
library, before any code of the workspace could put another in its place. With GYRE_AGENT_CODE_DIRS and
GYRE_EXIT_REPORT_FD set (Harbor), a process that loads the agent's code reports an os._exit of its own, and
the standard library and the test runner are never imported from the agent's directories (runner_imports).
"""

import os
import sys


def _workspace_after_stdlib(workspace: str) -> None:
    if workspace in sys.path:
        return
    site = [i for i, p in enumerate(sys.path) if p.endswith(("site-packages", "dist-packages"))]
    sys.path.insert(site[0] if site else len(sys.path), workspace)


if os.environ.get("GYRE_TEST_WORKSPACE"):
    _workspace_after_stdlib(os.environ["GYRE_TEST_WORKSPACE"])
if os.environ.get("GYRE_TEST_REPORT_DIR"):
    import gyre_test_report

    gyre_test_report.hook_unittest()
if os.environ.get("GYRE_AGENT_CODE_DIRS") and os.environ.get("GYRE_EXIT_REPORT_FD"):
    import gyre_test_report
    import runner_imports

    runner_imports.install(os.environ["GYRE_AGENT_CODE_DIRS"].split(":"))

    gyre_test_report.watch_agent_code(
        os.environ["GYRE_AGENT_CODE_DIRS"].split(":"), int(os.environ["GYRE_EXIT_REPORT_FD"])
    )
