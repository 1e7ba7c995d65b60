"""Temporary directories that go with the process (gyre.fsutil): a session's proxy socket, a grading's copy of
the workspace, the admin key's file. A rank leaves with os._exit (gyre.sched.launch.job.exit_now), which
skips the finally of every thread still inside one and every atexit hook."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.fsutil import process_dir, remove_temporary_dirs, scratch_dir

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]

# a thread inside a scratch directory (a grading, a session) when the process leaves as argv[1] says
LEAVE = """
import os, sys, threading
from gyre.fsutil import process_dir, scratch_dir
from gyre.engine.admin_key import sglang_key_config

inside = threading.Event()

def grading():
    with scratch_dir("gyre-grade-"):
        inside.set()
        threading.Event().wait()

threading.Thread(target=grading, daemon=True).start()
inside.wait()
sglang_key_config()  # the admin key's file, in a directory of the process's own
if sys.argv[1] == "exit_now":
    from gyre.sched.launch.job import exit_now
    exit_now(0)
if sys.argv[1] == "os._exit":
    os._exit(0)
"""  # "return": a normal exit, atexit hooks and all


@pytest.mark.parametrize(
    ("leave", "left"), [("exit_now", []), ("return", []), ("os._exit", ["gyre-grade-", "gyre-keys-"])]
)
def test_a_process_removes_its_temporary_dirs_however_it_leaves_but_by_a_bare_os_exit(tmp_path, leave, left):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    # gyre.sched.launch.job imports mpi4py's MPI: as a world of one rank that left by os._exit, MPICH's shared
    # memory (/dev/shm/mpich_shm_<pid>_0) would stay until the machine restarts; a rank's world is not the point
    env["MPI4PY_RC_INITIALIZE"] = "false"
    subprocess.run([sys.executable, "-c", LEAVE, leave], check=True, env=env, timeout=60)
    assert sorted(p.name[: p.name.rindex("-") + 1] for p in tmp.iterdir()) == left


def test_a_scratch_dir_goes_when_its_block_ends_and_is_not_removed_twice(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with scratch_dir("gyre-test-") as path:
        assert path.is_dir() and path.parent == tmp_path
        (path / "f").write_text("x")
    assert not path.exists()
    kept = process_dir("gyre-test-")
    assert kept.is_dir()
    remove_temporary_dirs()
    assert not kept.exists() and list(tmp_path.iterdir()) == []


def test_a_forked_child_leaving_does_not_remove_its_parents_dirs(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with scratch_dir("gyre-test-") as path:
        pid = os.fork()
        if pid == 0:  # the child leaves as a Python process does, its inherited hook and table and all
            remove_temporary_dirs()
            os._exit(0 if path.is_dir() else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0 and path.is_dir()
    assert not path.exists()
