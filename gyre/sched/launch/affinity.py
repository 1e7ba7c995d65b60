"""CPU sets for the ranks of a local cell job, so that the three schedulers run on the same hardware.

On a cluster each cell owns its nodes. On one machine, `sched.cpu_sets` gives each rank (controller
first) a CPU list such as "0-3" or "4,5"; by default the controller (proxy, harness processes) may use
every CPU and cell i gets CPU (i - 1) mod n. With fewer CPUs than cells (2 CPUs, 3 cells) cells must
share: cell 1 and cell 3 both get CPU 0. The mapping is the same whichever scheduler runs, which is
what makes their wall-clock times comparable. A cell's engine subprocess inherits the rank's set.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def parse_cpu_list(spec: str) -> set[int]:
    """ "0-2,5" -> {0, 1, 2, 5}."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError as e:
            raise ValueError(f"CPU list {spec!r}: {part!r} is not N or N-M") from e
        if first > last or first < 0:
            raise ValueError(f"CPU list {spec!r}: {part!r} is an empty or negative range")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"CPU list {spec!r} names no CPU")
    return cpus


def cpu_plan(n_ranks: int, available: Sequence[int], specs: Sequence[str] = ()) -> list[set[int]]:
    """The CPU set of each rank (rank 0 the controller)."""
    avail = sorted(available)
    if specs:
        if len(specs) != n_ranks:
            raise ValueError(
                f"sched.cpu_sets has {len(specs)} entries; give one per rank ({n_ranks}: controller, then each cell)"
            )
        plan = [parse_cpu_list(s) for s in specs]
        if bad := sorted(set().union(*plan) - set(avail)):
            raise ValueError(f"sched.cpu_sets names CPUs {bad} this process may not use (it has {avail})")
        return plan
    return [set(avail)] + [{avail[(i - 1) % len(avail)]} for i in range(1, n_ranks)]


def pin(cpus: set[int], threads: int) -> None:
    """Bind this process (and what it starts later) to `cpus`, with `threads` OpenMP threads for what it
    starts (its replica sets torch's own count when it builds)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    os.environ["OMP_NUM_THREADS"] = str(threads)


def available_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
