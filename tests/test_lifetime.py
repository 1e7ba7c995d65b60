"""Children that die with the process that started them (gyre.lifetime), whichever thread started them."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# a parent that starts a child from a thread which then ends, and waits; it prints the child's pid
PARENT = """
import threading, time
from gyre.lifetime import spawn_tied
pids = []
t = threading.Thread(target=lambda: pids.append(spawn_tied(["sleep", "60"]).pid))
t.start(); t.join()
print(pids[0], flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def _kill_parent_then_child_is_gone(parent_code: str, ready: Callable[[int], bool]) -> None:
    """Start `parent_code`, which prints its child's pid; once `ready(child)`, SIGKILL the parent (no clean-up
    of any kind) and assert that the child ends within 5 s."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True, env=env)
    child = int(parent.stdout.readline())
    try:
        assert ready(child)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(child), "the child outlived its SIGKILLed parent"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()


@pytest.mark.integration
def test_a_child_outlives_the_thread_that_started_it_and_not_its_process():
    def still_alive(child: int) -> bool:
        time.sleep(0.3)
        return _alive(child)  # False: it died with the thread that started it

    _kill_parent_then_child_is_gone(PARENT, still_alive)


# a parent started as `nohup cmd &` would be: SIGHUP, SIGINT and SIGQUIT ignored; it prints its children's
# ignored-signal masks (/proc/<pid>/status SigIgn), one started each way
IGNORING_PARENT = """
import signal, subprocess
from gyre.lifetime import spawn_tied, tie_to_this_thread, tied_to_this_thread
for s in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT):
    signal.signal(s, signal.SIG_IGN)
show = ["grep", "SigIgn", "/proc/self/status"]
print(subprocess.run(show, capture_output=True, text=True).stdout.split()[1])
print(subprocess.run(show, capture_output=True, text=True, preexec_fn=tie_to_this_thread()).stdout.split()[1])
child = spawn_tied(show, stdout=subprocess.PIPE, text=True)
print(child.communicate()[0].split()[1])
argv, preexec_fn = tied_to_this_thread(show)
assert preexec_fn is None  # tied by its command: Popen may vfork
print(subprocess.run(argv, capture_output=True, text=True).stdout.split()[1])
"""


@pytest.mark.unit
def test_a_tied_child_does_not_inherit_signals_its_parent_ignores():
    """Agent code that signals its checker must kill it (scored checker_killed) however the run was started."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", IGNORING_PARENT], capture_output=True, text=True, env=env, check=True)
    plain, tied, spawned, by_command = (int(m, 16) for m in out.stdout.split())
    stop = (1 << (signal.SIGHUP - 1)) | (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGQUIT - 1))
    assert plain & stop == stop  # a plain Popen inherits them
    assert tied & stop == 0 and spawned & stop == 0 and by_command & stop == 0


# a parent that starts a child tied by its command and waits; it prints the child's pid
COMMAND_TIED_PARENT = """
import subprocess, time
from gyre.lifetime import tied_to_this_thread
argv, preexec_fn = tied_to_this_thread(["sleep", "60"])
print(subprocess.Popen(argv, preexec_fn=preexec_fn).pid, flush=True)
time.sleep(60)
"""


@pytest.mark.integration
def test_a_child_tied_by_its_command_dies_with_its_sigkilled_parent():
    """A harness or checker, started without a preexec_fn (so that Popen can vfork), still ends with the run."""

    def sleeping(child: int) -> bool:
        deadline = time.monotonic() + 5  # env, setpriv and sh exec in turn; then it is sleep
        while "sleep" not in Path(f"/proc/{child}/cmdline").read_bytes().decode() and time.monotonic() < deadline:
            time.sleep(0.02)
        return _alive(child)

    _kill_parent_then_child_is_gone(COMMAND_TIED_PARENT, sleeping)


@pytest.mark.unit
def test_a_child_tied_by_its_command_ends_itself_when_its_parent_died_before_the_signal_was_armed(tmp_path):
    """The kernel sends nothing to a child whose parent died before the child armed PR_SET_PDEATHSIG: the
    child's shell sees another parent and ends it before it execs the command."""
    from gyre.lifetime import tied_to_this_thread

    argv, preexec_fn = tied_to_this_thread(["touch", "ran"], signal.SIGTERM)
    assert preexec_fn is None
    assert subprocess.run(argv, cwd=tmp_path, timeout=30).returncode == 0 and (tmp_path / "ran").exists()
    (tmp_path / "ran").unlink()
    argv[argv.index(str(os.getpid()))] = "1"  # as if its parent had been another, now gone
    assert subprocess.run(argv, cwd=tmp_path, timeout=30).returncode == -signal.SIGTERM
    assert not (tmp_path / "ran").exists()


@pytest.mark.unit
def test_the_weights_a_killed_cell_left_in_memory_go_when_the_next_cell_starts(tmp_path):
    """A cell keeps the weights its engine restarts from in /dev/shm and removes them when it stops; a SIGKILLed
    cell cannot (a full run of this suite left ~20 of them, with a real model each would hold gigabytes of the
    node's memory). The next cell removes every such directory of this user whose process is gone, and nothing
    else: a living cell's, one whose name has no pid, anything not a cell's."""
    from gyre.sched.cell.engine import SCRATCH_PREFIX, cell_scratch, remove_orphaned_scratch

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orphan = tmp_path / f"{SCRATCH_PREFIX}{gone.pid}-k3x_9q2a"
    (orphan / "current").mkdir(parents=True)
    (orphan / "current" / "model.safetensors").write_bytes(b"\0" * 4096)
    living = tmp_path / f"{SCRATCH_PREFIX}{os.getpid()}-a1b2c3d4"
    nameless = tmp_path / f"{SCRATCH_PREFIX}a1b2c3d4"  # an older release's name: whose it was is unknown
    other = tmp_path / f"gyre-something-{gone.pid}-x"
    for path in (living, nameless, other):
        path.mkdir()
    assert remove_orphaned_scratch(tmp_path) == [orphan]
    assert not orphan.exists() and living.is_dir() and nameless.is_dir() and other.is_dir()
    scratch = cell_scratch()  # in /dev/shm here, named after this process
    try:
        assert scratch.parent == Path("/dev/shm") and scratch.name.startswith(f"{SCRATCH_PREFIX}{os.getpid()}-")
    finally:
        scratch.rmdir()
