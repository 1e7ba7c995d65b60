"""What MPICH leaves in /tmp and /dev/shm when a job aborts: which files the launcher removes."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre.sched.launch.mpich_leftovers import main, remove_leftovers

pytestmark = pytest.mark.unit

# a running job: its proxy holds the topology file open, its ranks map their segment (and may close its fd)
HOLDER = """import ctypes, os, sys, time
f = open(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
fd = os.open(sys.argv[2], os.O_RDWR)
assert libc.mmap(None, 4096, 3, 1, fd, 0) not in (None, ctypes.c_void_p(-1).value)  # PROT_READ|PROT_WRITE, MAP_SHARED
os.close(fd)
print("ready", flush=True)
time.sleep(60)
"""


def test_only_this_users_new_files_no_process_holds_are_removed(tmp_path):
    tmp, shm = tmp_path / "tmp", tmp_path / "shm"
    tmp.mkdir(), shm.mkdir()
    places = ((tmp, "hydra_hwloc_xmlfile_"), (shm, "mpich_shm_"))
    since = time.time()
    orphans = [tmp / "hydra_hwloc_xmlfile_orphan", shm / "mpich_shm_orphan_0"]
    open_file, mapped = tmp / "hydra_hwloc_xmlfile_live", shm / "mpich_shm_live_0"
    old, unrelated = shm / "mpich_shm_old_0", tmp / "hydra_other"
    for path in [*orphans, open_file, mapped, old, unrelated]:
        path.write_bytes(b"x" * 4096)
    os.utime(old, (since - 600, since - 600))  # an earlier job's: not this one's to judge
    kept = [open_file, mapped, old, unrelated]
    if os.getuid() == 0:  # another user's (only root can make one)
        others = shm / "mpich_shm_others_0"
        others.write_bytes(b"x")
        os.chown(others, 65534, -1)
        kept.append(others)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(open_file), str(mapped)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"ready\n"
        assert str(mapped) not in _open_files(holder.pid)  # held by its mapping alone
        removed = remove_leftovers(since, places)
    finally:
        holder.kill()
        holder.wait()
    assert sorted(removed) == sorted(orphans)
    assert not any(p.exists() for p in orphans) and all(p.exists() for p in kept)


def _open_files(pid: int) -> set[str]:
    return {os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()}


def test_the_command_a_slurm_node_runs_removes_its_orphans_since_the_time_given(capsys):
    """`python -m gyre.sched.launch.mpich_leftovers SINCE`, run on every node after a failed start
    (launch/slurm/sbatch.py): this node's real /dev/shm."""
    since = time.time()
    orphan, held = (
        Path(f"/dev/shm/mpich_shm_gyretest{os.getpid()}_0"),
        Path(f"/dev/shm/mpich_shm_gyretest{os.getpid()}_1"),
    )
    for path in (orphan, held):
        path.write_bytes(b"x" * 4096)
    with held.open("rb"):
        try:
            assert main([str(since)]) == 0
            assert not orphan.exists() and held.exists()
            assert orphan.name in capsys.readouterr().out
        finally:
            orphan.unlink(missing_ok=True)
            held.unlink(missing_ok=True)
    for wrong in (["yesterday"], []):
        with pytest.raises(SystemExit) as refused:
            main(wrong)
        assert refused.value.code == 2
    assert "usage: python -m gyre.sched.launch.mpich_leftovers [-h] SINCE" in capsys.readouterr().err
