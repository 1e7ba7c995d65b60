"""Children that die with the process that started them (gyre.lifetime), whichever thread started them."""

import os
import signal
import subprocess
import sys
import time
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


@pytest.mark.integration
def test_a_child_outlives_the_thread_that_started_it_and_not_its_process():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=env)
    child = int(parent.stdout.readline())
    try:
        time.sleep(0.3)
        assert _alive(child), "the child died with the thread that started it"
        parent.kill()  # SIGKILL: no clean-up of any kind
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
