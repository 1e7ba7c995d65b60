"""What MPICH leaves on a machine when a job ends in MPI_Abort or is killed, and its removal.

MPICH's process manager (hydra_pmi_proxy) writes the machine's topology for its ranks to
/tmp/hydra_hwloc_xmlfile_* (a fixed directory: TMPDIR aside), and the ranks of a node share memory through
/dev/shm/mpich_shm_*. Both go when the job ends normally, neither when it ends in MPI_Abort (a rank's expected
failure, an exception under `-m mpi4py`) or is killed: a file in /tmp each time, and the segment's memory
(1-4 MiB here) until the machine restarts. A live job holds both open (the proxy its file, the ranks their
segment, open and mapped), so a file of this user that no process holds is left over.

The local launcher removes them after a job that ended non-zero (gyre.sched.launch.local); a Slurm job's script,
after a start that failed, runs `python -m gyre.sched.launch.mpich_leftovers SINCE` on every node of the job
(launch/slurm/sbatch.py), since a step's ranks are killed together with anything that would clean up after them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import time
from pathlib import Path

LEFTOVERS = ((Path("/tmp"), "hydra_hwloc_xmlfile_"), (Path("/dev/shm"), "mpich_shm_"))


def held_open(prefixes: tuple[str, ...]) -> set[str]:
    """Paths whose name starts with one of `prefixes` that a live process this user can inspect has open or
    mapped. A process that is exiting (its memory already released: an empty command line) closes its files
    next and does not count: a rank ending after mpirun has returned is one."""
    held: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):  # another user's process, or gone meanwhile
            if not (proc / "cmdline").read_bytes():
                continue
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):  # closed meanwhile
                    held.add(os.readlink(fd))
            with (proc / "maps").open() as maps:
                held.update(line.split(maxsplit=5)[-1].rstrip("\n") for line in maps if "/" in line)
    return {path for path in held if Path(path).name.startswith(prefixes)}


def remove_leftovers(since: float, places: tuple[tuple[Path, str], ...] = LEFTOVERS) -> list[Path]:
    """Remove MPICH's files of this user made since `since` (the job's start) that no live process holds
    (`held_open`); returns them."""
    held = held_open(tuple(prefix for _, prefix in places))
    removed = []
    for folder, prefix in places:
        for path in folder.glob(f"{prefix}*"):
            try:
                st = path.lstat()
            except FileNotFoundError:
                continue
            if st.st_uid == os.getuid() and st.st_mtime >= since - 1 and str(path) not in held:
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed


def wait_until_gone(cmdline_part: bytes, timeout_s: float = 30.0) -> None:
    """Wait (at most `timeout_s`) until no process's command line contains `cmdline_part` (its arguments joined
    by NUL): after MPI_Abort, mpirun can return while ranks are still exiting, holding their segment."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        running = False
        for proc in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                if proc.name.isdigit() and cmdline_part in (proc / "cmdline").read_bytes():
                    running = True
                    break
        if not running:
            return
        time.sleep(0.1)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gyre.sched.launch.mpich_leftovers",
        description="Remove what MPICH left on this node (the Slurm script runs it on every node after a start "
        "that failed): this user's /dev/shm/mpich_shm_* and /tmp/hydra_hwloc_xmlfile_* made since SINCE that no "
        "process has open or mapped.",
    )
    parser.add_argument("since", metavar="SINCE", type=float, help="seconds since the epoch (the job's start)")
    since = parser.parse_args(argv).since
    if removed := remove_leftovers(since):
        names = " ".join(sorted(path.name for path in removed))
        print(f"gyre: removed what MPICH left on {socket.gethostname()}: {names}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
