"""Whether this process may make a user namespace of its own, which the bwrap sandbox needs, and if not which
setting of the site forbids it.

Cluster users are never root, so bwrap (not setuid on Debian) makes every sandbox through an unprivileged user
namespace. Sites turn those off in one of three ways: Debian's and Ubuntu's `kernel.unprivileged_userns_clone=0`,
`user.max_user_namespaces=0`, or Ubuntu 24.04's AppArmor `kernel.apparmor_restrict_unprivileged_userns=1` (the
namespace is made but holds no capabilities: its uid map cannot be written). A probe in a child process does what
bwrap does first (unshare, then map its own uid), so a refusal names the real cause before any rollout runs,
instead of every sandbox failing with bwrap's own terse error.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

from gyre.sandbox.base import host_python

# (sysctl, the value that forbids unprivileged user namespaces)
SETTINGS = (
    ("kernel.unprivileged_userns_clone", "0"),
    ("user.max_user_namespaces", "0"),
    ("kernel.apparmor_restrict_unprivileged_userns", "1"),
)
# Run with -I -S in a child: make a user namespace and map this uid into it, as bwrap does; prints the failing step
PROBE = """import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.getuid(), os.getgid()
if libc.unshare(0x10000000) != 0:
    raise SystemExit('unshare(CLONE_NEWUSER): ' + os.strerror(ctypes.get_errno()))
try:
    for name, text in (('setgroups', 'deny'), ('uid_map', f'0 {uid} 1'), ('gid_map', f'0 {gid} 1')):
        with open(f'/proc/self/{name}', 'w') as f:
            f.write(text)
except OSError as e:
    raise SystemExit(f'writing /proc/self/{name}: {e.strerror}')
"""


def sysctl(name: str) -> str | None:
    """A sysctl's value as /proc/sys shows it to this process (None where this kernel has no such setting)."""
    try:
        return Path("/proc/sys", *name.split(".")).read_text().strip()
    except OSError:
        return None


def probe_failure(python: str | None = None) -> str:
    """'' when a child of this process can make a user namespace and map its uid into it, else the failing step."""
    try:
        proc = subprocess.run([python or host_python(), "-I", "-S", "-c", PROBE], capture_output=True, text=True,
                              timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    return "" if proc.returncode == 0 else (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]


@functools.cache
def userns_refusal() -> str:
    """'' when user namespaces work here; else one line naming the setting that forbids them and what to use."""
    failure = probe_failure()
    if not failure:
        return ""
    named = [f"{name}={value}" for name, value in SETTINGS if sysctl(name) == value]
    cause = " and ".join(named) if named else f"the kernel refuses them: {failure}"
    return (
        f"unprivileged user namespaces are disabled here ({cause}), and sandbox.backend=bwrap needs them: "
        "set sandbox.backend=apptainer (a setuid Apptainer install runs without them), or ask the site to "
        "allow them"
    )
