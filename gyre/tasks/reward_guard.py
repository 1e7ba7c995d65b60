"""Building the Harbor reward guard (gyre/tasks/runner_hooks/reward_guard.c, what it does: harbor_checker).

It is a small shared library preloaded into a Harbor task's test script, so it is built on the grading host
with its C compiler, once per version of its source, into the user's cache, and bound read-only into the
grading sandbox.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading
import uuid
from pathlib import Path

REWARD_GUARD_SOURCE = Path(__file__).with_name("runner_hooks") / "reward_guard.c"


class GuardUnavailable(Exception):
    """The Harbor reward guard cannot be built here; the message says what to install."""


_guard_build = threading.Lock()


def reward_guard_library() -> Path:
    """The reward guard (harbor_checker), built once per source version into the user's cache with the C compiler."""
    source = REWARD_GUARD_SOURCE.read_bytes()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gyre" / "reward-guard"
    target = cache / f"reward_guard-{hashlib.sha256(source).hexdigest()[:16]}.so"
    with _guard_build:
        if not target.is_file():
            _build_guard(target)
    return target


def _build_guard(target: Path) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise GuardUnavailable("grading Harbor tasks needs a C compiler (cc) to build the reward guard: "
                               "apt-get install gcc (tools/setup_env.sh installs it)")  # fmt: skip
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{uuid.uuid4().hex}")  # a home shared by nodes
    proc = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(REWARD_GUARD_SOURCE), "-ldl"],
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        raise GuardUnavailable(f"building the reward guard failed: {proc.stderr.strip()[-400:]}")
    os.replace(partial, target)
