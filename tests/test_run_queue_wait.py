"""The scheduler benchmark's run-queue wait per process (tools/bench_schedulers.run_queue_wait_s): what it reads
is the time a process stood runnable without a CPU. Integration tier: it pins processes to the machine's CPUs,
which the unit tier's parallel workers share."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tools.bench_schedulers import run_queue_wait_s

pytestmark = pytest.mark.integration


def test_run_queue_wait_counts_the_seconds_a_process_stood_waiting_for_a_cpu() -> None:
    """Two processes spinning on one CPU each wait about half their time for it (schedstat), one spinning
    alone on another CPU runs as long and hardly waits; a process that is gone reads as 0.0."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.fail(f"this test needs two CPUs to pin to; this process may run on {cpus}")
    spin = "import os, sys, time\nos.sched_setaffinity(0, {int(sys.argv[1])})\nt = time.monotonic()\n"
    spin += "while time.monotonic() - t < 1.5: pass"
    shared = [subprocess.Popen([sys.executable, "-c", spin, str(cpus[0])]) for _ in range(2)]
    alone = subprocess.Popen([sys.executable, "-c", spin, str(cpus[-1])])
    time.sleep(1.2)
    waits = [run_queue_wait_s(p.pid) for p in (*shared, alone)]
    for p in (*shared, alone):
        p.wait()
    assert waits[0] > 0.35 and waits[1] > 0.35, waits  # each ran about half of the shared CPU's ~1.1 s
    assert waits[2] < 0.25, waits  # its CPU seconds (~1.1) are not what is read
    assert run_queue_wait_s(alone.pid) == 0.0  # reaped: no /proc entry
