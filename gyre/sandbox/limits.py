"""Limits the kernel would not apply on its own: a pids cgroup per sandbox when the run is root, and the
trainer's own descriptors (its open-file limit raised, each rollout's connections capped to fit).

RLIMIT_NPROC (set by inside.py) is not enforced for processes of host root, and a bwrap sandbox started by
root runs its uid 1000 as host root: a fork bomb inside would take the host's process table. So a root run
puts each sandbox in its own pids cgroup (pids.max = sandbox.processes), made here, entered by a tiny
shell before it execs bwrap. Empty cgroups of finished sandboxes are removed when a later one is made, at
most once every SWEEP_EVERY_S: a run makes hundreds of sandboxes a minute, and sweeping a minute's worth of
cgroups at each took a run's controller 2 s of CPU in 77.
A run that is not root gets RLIMIT_NPROC, counted per sandbox (the sandbox's user namespace has its own
count), and needs none of this.
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)
CGROUP_ROOT = Path("/sys/fs/cgroup")
PARENT_NAME = "gyre-sandboxes"
STALE_S = 60.0  # an empty cgroup older than this belongs to a finished sandbox (never to one being started)
SWEEP_EVERY_S = 10.0
ENTER = 'echo $$ > "$0" && exec "$@"'  # sh -c ENTER PROCS_FILE ARGV...: join the cgroup, then become ARGV


@functools.cache
def pids_parent() -> Path | None:
    """The directory under which this root run makes sandboxes' pids cgroups; None when not root or none is
    writable (then a warning says the process limit is not enforced)."""
    if os.geteuid() != 0:
        return None
    for parent, enable in ((CGROUP_ROOT / "pids" / PARENT_NAME, False), (CGROUP_ROOT / PARENT_NAME, True)):
        try:
            if enable and "pids" not in (CGROUP_ROOT / "cgroup.controllers").read_text().split():
                continue
            if not enable and not (CGROUP_ROOT / "pids").is_dir():
                continue
            parent.mkdir(exist_ok=True)
            if enable:  # cgroup v2: let the leaves have a pids controller
                (parent / "cgroup.subtree_control").write_text("+pids")
            return parent
        except OSError as e:
            log.debug("no pids cgroup at %s: %s", parent, e)
    log.warning(
        "running as root without a writable pids cgroup: sandbox.processes is not enforced (the kernel exempts "
        "host root from RLIMIT_NPROC); run Gyre as an unprivileged user"
    )
    return None


def sweep(parent: Path, older_than_s: float = STALE_S) -> None:
    """Remove the empty cgroups of finished sandboxes (rmdir refuses one that still holds a process)."""
    now = time.time()
    with os.scandir(parent) as entries:
        for leaf in entries:
            try:
                if leaf.is_dir(follow_symlinks=False) and now - leaf.stat().st_mtime > older_than_s:
                    os.rmdir(leaf.path)
            except OSError:
                pass


_last_sweep = -SWEEP_EVERY_S  # time.monotonic() of this process's last sweep


def pids_prefix(max_pids: int) -> list[str]:
    """The command prefix that runs a sandbox in a new pids cgroup of at most `max_pids` tasks ([] when not
    needed or not possible)."""
    global _last_sweep
    parent = pids_parent()
    if parent is None:
        return []
    if time.monotonic() - _last_sweep >= SWEEP_EVERY_S:
        _last_sweep = time.monotonic()
        sweep(parent)
    leaf = parent / uuid.uuid4().hex[:16]
    try:
        leaf.mkdir()
        (leaf / "pids.max").write_text(str(max_pids))
    except OSError as e:
        log.warning("cannot make a pids cgroup at %s (%s): this sandbox's process limit is not enforced", leaf, e)
        return []
    return ["/bin/sh", "-c", ENTER, str(leaf / "cgroup.procs")]


RESERVED_DESCRIPTORS = 512  # the trainer's own: engines, logs, shards, MPI, the proxy's listeners
DESCRIPTORS_PER_CONNECTION = 3  # a relayed connection in the trainer: endpoint socket, its upstream, the proxy's


def raise_open_file_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit (many sites default to a soft 1024 under a
    far higher hard limit); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, e)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connections_per_rollout(wanted: int, concurrent_rollouts: int) -> int:
    """What each rollout's endpoint may hold so that `concurrent_rollouts` rollouts, each at its cap, leave
    RESERVED_DESCRIPTORS of the trainer's open-file limit free: `wanted`, or fewer (at least 1, with a warning)."""
    limit = raise_open_file_limit()
    fits = (limit - RESERVED_DESCRIPTORS) // (DESCRIPTORS_PER_CONNECTION * max(1, concurrent_rollouts))
    if fits >= wanted:
        return wanted
    log.warning(
        "open-file limit %d: %d rollouts at once get %d connections each, not sandbox.relay_connections=%d "
        "(raise the hard limit, ulimit -Hn, or lower harness.concurrency)",
        limit, concurrent_rollouts, max(1, fits), wanted,
    )  # fmt: skip
    return max(1, fits)
