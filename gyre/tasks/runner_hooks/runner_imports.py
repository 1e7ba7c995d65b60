"""Imports the agent's directories cannot take over in a Harbor task's tests. Standard library only; loaded by
sitecustomize in each Python process of the tests, with GYRE_AGENT_CODE_DIRS set (gyre.tasks.harbor_checker).

`python3 -m pytest /tests/test_outputs.py`, run from the task's working directory, puts that directory first
on the import path: an agent that leaves `pytest.py` (or `json.py`, which pytest imports) there runs its own
code in pytest's place and exits 0, and the test script writes the reward. Harbor's tests may import the
agent's modules from there, so the directory stays on the path; but a top-level module of the standard library
or of the test runner (`RUNNER`, `pytest_*` plugins) is found only outside the agent's directories (an
environment's site-packages in them counts as outside: the venv a test script makes in its working
directory), and is missing where nothing else has it, never the agent's. So are the installed distributions
whose entry points pytest loads as plugins. A script of the agent's the tests run (`python3 /app/main.py`) is
the agent's own program: its imports stay as Python makes them.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import PathFinder
from typing import Any

# pytest, its plugins' prefix aside, and what it imports of its own accord (the SWE-bench checker removes them too)
RUNNER = frozenset({"pytest", "_pytest", "pluggy", "iniconfig", "py", "packaging", "tomli", "exceptiongroup",
                    "colorama", "pygments", "gyre_test_report", "sitecustomize", "usercustomize"})  # fmt: skip


def stdlib_names() -> frozenset[str]:
    names = set(sys.builtin_module_names) | set(getattr(sys, "stdlib_module_names", ()))
    if not hasattr(sys, "stdlib_module_names"):  # before 3.10: what the standard library's directories hold
        import sysconfig

        stdlib = sysconfig.get_paths()["stdlib"]
        for directory in (stdlib, os.path.join(stdlib, "lib-dynload")):
            entries = os.listdir(directory) if os.path.isdir(directory) else []
            names.update(e.split(".")[0] for e in entries if e.split(".")[0].isidentifier())
        names -= {"test", "tests"}  # the interpreter's own test suite, where an image keeps it: not a module to guard
    return frozenset(names)


class OutsideAgentCode:
    """A meta path finder before the path finder: protected top-level names from entries outside `dirs`."""

    def __init__(self, dirs: list[str]) -> None:
        self.prefixes = _dirs(dirs)
        self.interpreter = _dirs([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix])
        self.protected = stdlib_names() | RUNNER

    def is_agents(self, entry: str) -> bool:
        """In the agent's directories, but for an environment's packages there (a venv the tests make there) and
        the running interpreter's own trees (an image whose Python lives under its working directory)."""
        where = os.path.realpath(entry or os.getcwd()) + "/"
        installed = {"site-packages", "dist-packages"} & set(where.split("/"))
        return where.startswith(self.prefixes) and not installed and not where.startswith(self.interpreter)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if path is not None or not (name in self.protected or name.startswith("pytest_")):
            return None
        entries = [e for e in sys.path if isinstance(e, str)]
        outside = [e for e in entries if not self.is_agents(e)]
        if len(outside) == len(entries):
            return None
        spec = PathFinder.find_spec(name, outside)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r} outside the agent's directories", name=name)
        return spec


def _dirs(paths: list[str]) -> tuple[str, ...]:
    real = {os.path.realpath(p) for p in paths if p}
    return tuple(r.rstrip("/") + "/" for r in real if r != "/")


def runs_agents_script(finder: OutsideAgentCode, argv: list[str]) -> bool:
    """`python3 [options] SCRIPT` with SCRIPT a file of the agent's directories: the agent's own program, whose
    imports stay as Python makes them (its `queue.py` beside it is its queue). A module (-m), code (-c) or a
    script elsewhere (a runner's console script, /tests/...) is not."""
    args = iter(argv[1:])
    for arg in args:
        if arg == "-" or not arg.startswith("-"):
            return os.path.isfile(arg) and finder.is_agents(os.path.dirname(os.path.abspath(arg)))
        if arg.startswith("--"):
            if arg == "--check-hash-based-pycs":
                next(args, None)
            continue
        for i, flag in enumerate(arg[1:], 1):
            if flag in "cm":
                return False
            if flag in "WX":
                if i == len(arg) - 1:
                    next(args, None)
                break
    return False


def install(dirs: list[str]) -> None:
    finder = OutsideAgentCode(dirs)
    argv = getattr(sys, "orig_argv", None)  # 3.10+; before, nothing tells the script yet: protected
    if finder.prefixes and not (argv and runs_agents_script(finder, argv)):
        at = next((i for i, f in enumerate(sys.meta_path) if f is PathFinder), len(sys.meta_path))
        sys.meta_path.insert(at, finder)
        _distributions_outside(finder)


def _distributions_outside(finder: OutsideAgentCode) -> None:
    """Installed distributions (importlib.metadata) are found only outside the agent's directories: pytest loads
    every `pytest11` entry point of them as a plugin, and a `*.dist-info` in the working directory named one."""
    original = PathFinder.find_distributions

    def find_distributions(context: Any = None, **kwargs: Any) -> Any:
        from importlib.metadata import DistributionFinder

        context = context if context is not None else DistributionFinder.Context(**kwargs)
        outside = [e for e in context.path if isinstance(e, str) and not finder.is_agents(e)]
        return original(DistributionFinder.Context(name=context.name, path=outside))

    PathFinder.find_distributions = staticmethod(find_distributions)  # type: ignore[method-assign]
