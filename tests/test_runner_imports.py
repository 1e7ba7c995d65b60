"""runner_hooks/runner_imports.py in a Python process as a Harbor task's tests start one (sitecustomize from
PYTHONPATH): the standard library and the test runner never come from the agent's directories, even first on the
import path; the agent's own modules, and an environment's packages made there, still do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.tasks.harbor_checker import RUNNER_HOOKS
from gyre.tasks.harbor_root import runner_config_above
from gyre.tasks.runner_hooks import runner_imports

pytestmark = pytest.mark.unit

PROBE = """import json, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
import argparse, pluggy, solution
try:
    import pytest_fake_plugin
    plugin = pytest_fake_plugin.__file__
except ImportError as e:
    plugin = str(e)
print(json.dumps({m.__name__: m.__file__ for m in (argparse, pluggy, solution)} | {"plugin": plugin}))
"""


def test_protected_modules_come_from_outside_the_agents_directories(tmp_path: Path) -> None:
    app = tmp_path / "app"
    site = app / ".venv" / "lib" / "python3.11" / "site-packages"  # a venv the test script makes in /app
    site.mkdir(parents=True)
    for name in ("argparse.py", "solution.py", "pytest_fake_plugin.py"):
        (app / name).write_text("VALUE = 1\n")
    (site / "pluggy.py").write_text("VALUE = 2\n")
    env = {**os.environ, "PYTHONPATH": str(RUNNER_HOOKS), "GYRE_AGENT_CODE_DIRS": f"{app}:{tmp_path / 'workspace'}",
           "GYRE_EXIT_REPORT_FD": "2"}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", PROBE, str(site), str(app)], env=env, cwd=app, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert not found["argparse"].startswith(str(app)) and found["solution"] == str(app / "solution.py")
    assert found["pluggy"] == str(site / "pluggy.py")
    # a runner plugin found only there is missing, never the agent's
    assert found["plugin"].startswith("No module named 'pytest_fake_plugin' outside the agent's directories")


def test_without_the_harbor_variables_nothing_changes(tmp_path: Path) -> None:
    (tmp_path / "argparse.py").write_text("VALUE = 1\n")
    env = {**os.environ, "PYTHONPATH": str(RUNNER_HOOKS)}
    env.pop("GYRE_AGENT_CODE_DIRS", None)
    out = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import argparse; "
                          "print(argparse.__file__)"], env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.stdout.strip() == str(tmp_path / "argparse.py"), out.stderr


def test_runner_configuration_above_the_tests_is_what_pytest_reads_at_root() -> None:
    dropped = runner_config_above(["/tests", "/logs"])
    assert dropped == sorted(f"/{n}" for n in ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg",
                                               "setup.py", "conftest.py", "uv.toml"))  # fmt: skip
    assert "/opt/gyre/pytest.ini" in runner_config_above(["/opt/gyre/uv"]) and "/pytest.ini" in dropped


def test_the_interpreters_own_trees_are_never_the_agents(tmp_path: Path) -> None:
    """An image whose Python lives under its working directory (WORKDIR /opt, Python in /opt/conda) still
    imports its standard library; the directory itself stays the agent's."""
    stdlib = tmp_path / "opt" / "conda" / "lib" / "python3.11"
    stdlib.mkdir(parents=True)
    finder = runner_imports.OutsideAgentCode([str(tmp_path / "opt")])
    finder.interpreter = runner_imports._dirs([str(tmp_path / "opt" / "conda")])
    assert not finder.is_agents(str(stdlib)) and finder.is_agents(str(tmp_path / "opt"))


@pytest.mark.parametrize(
    ("argv", "agents"),
    [
        (["python3", "{app}/main.py"], True),
        (["python3", "-u", "-X", "dev", "-Wignore", "{app}/main.py", "-m", "x"], True),
        (["python3", "-m", "pytest", "/tests/test_outputs.py"], False),
        (["python3", "-Bm", "pytest"], False),  # with a file named pytest in the working directory
        (["python3", "-c", "import main", "{app}/main.py"], False),
        (["python3", "/tests/test_outputs.py"], False),
        (["/usr/bin/pytest", "/tests/test_outputs.py"], False),
        (["python3", "-W", "{app}/main.py", "/tests/test_outputs.py"], False),  # -W's value, then the script
    ],
)
def test_only_a_script_of_the_agents_runs_unprotected(argv: list[str], agents: bool, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    app = tmp_path / "app"
    app.mkdir()
    (app / "main.py").write_text("import queue\n")
    (app / "pytest").write_text("")
    monkeypatch.chdir(app)
    finder = runner_imports.OutsideAgentCode([str(app)])
    assert runner_imports.runs_agents_script(finder, [a.format(app=app) for a in argv]) is agents


def test_the_agents_own_program_imports_its_own_modules(tmp_path: Path) -> None:
    """python3 /app/main.py beside its queue.py gets its queue.py, as plain Python gives it."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "queue.py").write_text("MINE = True\n")
    (app / "main.py").write_text("import queue\nprint(getattr(queue, 'MINE', False))\n")
    env = {**os.environ, "PYTHONPATH": str(RUNNER_HOOKS), "GYRE_AGENT_CODE_DIRS": str(app), "GYRE_EXIT_REPORT_FD": "2"}
    out = subprocess.run([sys.executable, str(app / "main.py")], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr
