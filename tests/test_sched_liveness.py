"""The controller's liveness watch (gyre.sched.liveness) against real processes: a rank killed with SIGKILL
is reported gone within a second; a living one, however busy, never is; a rank that never connects is named."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from gyre.sched.liveness import LivenessWatch, connect

pytestmark = pytest.mark.unit

# a stand-in cell leader: connects, names its rank, then sleeps (SIGKILLed by the test) or spins
CELL = """
import sys, time
from gyre.sched.liveness import connect
sock = connect(sys.argv[1], int(sys.argv[2]))
print("connected", flush=True)
end = time.monotonic() + 30
while time.monotonic() < end:
    if sys.argv[3] != "busy":
        time.sleep(1)
"""


def start_cell(address: str, rank: int, mode: str = "idle") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CELL, address, str(rank), mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "connected"
    return proc


def wait_gone(watch: LivenessWatch, rank: int, timeout_s: float) -> float:
    start = time.monotonic()
    while rank not in watch.gone():
        assert time.monotonic() - start < timeout_s, f"rank {rank} not seen gone within {timeout_s} s"
        time.sleep(0.01)
    return time.monotonic() - start


def test_a_killed_rank_is_seen_gone_at_once_and_a_busy_one_never() -> None:
    watch = LivenessWatch("127.0.0.1")
    cells = {rank: start_cell(watch.address, rank, mode) for rank, mode in ((1, "busy"), (2, "idle"), (3, "idle"))}
    try:
        assert watch.identify([1, 2, 3], timeout_s=10) == []
        assert watch.gone() == set()
        cells[3].send_signal(signal.SIGKILL)
        assert wait_gone(watch, 3, timeout_s=2.0) < 1.0
        time.sleep(0.5)
        assert watch.gone() == {3}  # the busy rank and the idle one still count as alive
    finally:
        for proc in cells.values():
            proc.kill()
            proc.wait()
    assert wait_gone(watch, 1, 2.0) >= 0 and wait_gone(watch, 2, 2.0) >= 0
    watch.close()
    assert watch.gone() == {1, 2, 3}  # what was seen stays seen


def test_ranks_that_never_connect_are_named_and_stay_unwatched() -> None:
    watch = LivenessWatch("127.0.0.1")
    proc = start_cell(watch.address, 1)
    try:
        start = time.monotonic()
        assert watch.identify([1, 2], timeout_s=1.0) == [2]
        assert time.monotonic() - start < 3.0
        assert watch.gone() == set()
    finally:
        proc.kill()
        proc.wait()
        watch.close()


def test_a_cell_that_cannot_reach_the_watch_gets_an_error_it_can_report() -> None:
    watch = LivenessWatch("127.0.0.1")
    address = watch.address
    watch.close()  # nothing listens there now
    with pytest.raises(OSError):
        connect(address, 1)
