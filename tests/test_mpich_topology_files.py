"""The topology files MPICH's process manager leaves in /tmp when a job aborts: which the launcher removes."""

import os
import subprocess
import sys
import time

import pytest

from gyre.sched.launch.local import remove_orphaned_topology_files

pytestmark = pytest.mark.unit


def test_only_this_users_new_files_no_process_holds_are_removed(tmp_path):
    since = time.time()
    orphan, live, old, others = (tmp_path / f"hydra_hwloc_xmlfile_{n}" for n in ("orphan", "live", "old", "other"))
    for path in (orphan, live, old):
        path.write_text("<topology/>")
    os.utime(old, (since - 600, since - 600))  # an earlier job's: not this one's to judge
    kept = [live, old]
    if os.getuid() == 0:  # another user's (only root can make one)
        others.write_text("<topology/>")
        os.chown(others, 65534, -1)
        kept.append(others)
    unrelated = tmp_path / "hydra_other"
    unrelated.write_text("")
    # a running job's proxy holds its file open: a child process here
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(live)!r}); import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while str(live) not in _open_files(holder.pid):
            assert time.monotonic() < deadline and holder.poll() is None, "the holder never opened its file"
            time.sleep(0.05)
        removed = remove_orphaned_topology_files(since, tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert removed == [orphan]
    assert not orphan.exists() and all(p.exists() for p in [*kept, unrelated])


def _open_files(pid: int) -> set[str]:
    try:
        return {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    except OSError:
        return set()
