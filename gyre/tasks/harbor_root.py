"""The writable image root of a Harbor task: what the agent writes outside its working directory reaches grading.

Harbor's verifier runs in the agent's container after the agent, so a task may have its agent write
`/output/moves.txt` and its tests read it there. A Harbor task that runs in its built image under bwrap gets
an overlay of the image's root (gyre/sandbox/overlay.py) in the agent's sandbox (the harness's, the oracle's
solve.sh); its changes are kept beside the workspace (`<workspace>.root/upper`), and grading stacks them,
read-only and cleared of anything in the way of a grading mount or a protected tree, under a fresh upper of
its own. HOME and /tmp stay private to each sandbox (a test script sources `$HOME/.local/bin/env` in its own
shell: the agent's HOME never reaches it). Nor do its copies of the files a test runner reads on its own in the
directories above the tests (`RUNNER_CONFIG`): `pytest /tests/test_outputs.py` takes `/pytest.ini` as its
configuration (`addopts = --collect-only` passes every test) and, with a `/setup.py`, loads `/conftest.py`.
"""

from __future__ import annotations

import os
from pathlib import Path

from gyre.sandbox import Sandbox
from gyre.sandbox.base import HOME
from gyre.sandbox.overlay import RootOverlay, drop_from_changes, protected_trees
from gyre.sandbox.rootfs import image_root, is_built_image
from gyre.tasks.task import Task

SANDBOX_OWN = ("/proc", "/dev", "/tmp", HOME, "/run/gyre", "/opt/gyre")  # what bwrap and gyre mount in every sandbox
# What pytest reads of the directories above the files it is given (its configuration, the rootdir's marker, the
# conftest.py files up to the rootdir) and uv of those above its working directory (uv.toml, pyproject.toml)
RUNNER_CONFIG = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg", "setup.py", "conftest.py",
                 "uv.toml")  # fmt: skip


def uses_root_overlay(task: Task, sandbox: Sandbox) -> bool:
    return task.checker == "harbor" and sandbox.name == "bwrap" and is_built_image(task.image)


def root_changes(workspace: Path) -> Path:
    """Where the agent's changes to the root of a rollout working in `workspace` are kept (beside it)."""
    return workspace.parent / f"{workspace.name}.root"


def agent_overlay(task: Task, sandbox: Sandbox, workspace: Path) -> RootOverlay | None:
    """The agent's writable root (its changes size-watched), None where the task's root stays read-only."""
    if not uses_root_overlay(task, sandbox):
        return None
    return RootOverlay.under(root_changes(Path(workspace).resolve()), watch_upper=True)


def grading_overlay(
    task: Task, sandbox: Sandbox, workspace: Path, scratch: Path, targets: list[str]
) -> RootOverlay | None:
    """The grading sandbox's root: the image, the agent's changes (if it made any) cleared of entries in the way
    of `targets` (the grading sandbox's mounts), of the image's protected trees and of the runner configuration
    above the targets, and a fresh upper in `scratch`."""
    if not uses_root_overlay(task, sandbox):
        return None
    changes = root_changes(Path(workspace).resolve()) / "upper"
    layers: tuple[Path, ...] = ()
    if changes.is_dir():
        root = image_root(task.image)
        assert root is not None
        dropped = [*targets, *SANDBOX_OWN, *protected_trees(root.rootfs, root.env), *runner_config_above(targets)]
        drop_from_changes(changes, dropped)
        layers = (changes,)
    return RootOverlay.under(scratch / "root", layers, watch_upper=True)  # the tests write there too, running its code


def runner_config_above(targets: list[str]) -> list[str]:
    """`RUNNER_CONFIG` in every directory above a grading mount (`/tests`: `/`): there the image's file, or none."""
    above = {os.path.dirname(t.rstrip("/")) for t in targets if t.startswith("/")}
    dirs = {a for d in above for a in [d, *(str(p) for p in Path(d).parents)]}
    return sorted(os.path.join(d, name) for d in dirs for name in RUNNER_CONFIG)
