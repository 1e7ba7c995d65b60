"""The sandbox's seccomp filter: classic BPF, written by hand, standard library only.

inside.py (the first process in a sandbox, before any agent code) loads it with `install()`; it is
inherited by every process the harness starts and cannot be removed. It refuses what a harness never
needs and what would let agent code leave or inspect the sandbox: new namespaces (unshare, setns,
clone with a CLONE_NEW* flag; clone3 answers ENOSYS so the C library falls back to clone, whose flags
a classic filter can read), ptrace and cross-process memory access, mounts (the old and the new mount
API), keyrings, bpf, perf, kernel modules and kexec. Other syscalls of a foreign ABI (i386 or x32 on
x86_64) answer ENOSYS, so no table but the native one is reachable.

Standard library only: inside.py loads this file by its path (its `-I` keeps gyre off sys.path).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000
# syscall numbers per architecture (x86_64: arch/x86/entry/syscalls/syscall_64.tbl; aarch64: the generic table)
REFUSED = {
    "x86_64": {
        "unshare": 272, "setns": 308, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
        "mount": 165, "umount2": 166, "pivot_root": 155, "open_tree": 428, "move_mount": 429, "fsopen": 430,
        "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "keyctl": 250, "add_key": 248,
        "request_key": 249, "bpf": 321, "perf_event_open": 298, "init_module": 175, "finit_module": 313,
        "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320,
    },
    "aarch64": {
        "unshare": 97, "setns": 268, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
        "mount": 40, "umount2": 39, "pivot_root": 41, "open_tree": 428, "move_mount": 429, "fsopen": 430,
        "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "keyctl": 219, "add_key": 217,
        "request_key": 218, "bpf": 280, "perf_event_open": 241, "init_module": 105, "finit_module": 273,
        "delete_module": 106, "kexec_load": 104, "kexec_file_load": 294,
    },
}  # fmt: skip
CLONE = {"x86_64": 56, "aarch64": 220}
CLONE3 = 435
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET (CLONE_NEWTIME shares clone's signal byte)
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

# classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h)
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000
OFFSET_NR, OFFSET_ARCH, OFFSET_ARG0 = 0, 4, 16  # struct seccomp_data; arg0's low 32 bits (little endian)
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> tuple[int, int, int, int]:
    return code, jt, jf, k


def program(arch: str | None = None) -> list[tuple[int, int, int, int]]:
    """The filter for `arch` (default: this machine's) as (code, jt, jf, k) instructions."""
    arch = arch or os.uname().machine
    if arch not in AUDIT_ARCH:
        raise OSError(f"no seccomp filter for architecture {arch!r}; known: {sorted(AUDIT_ARCH)}")
    eperm, enosys = RET_ERRNO | errno.EPERM, RET_ERRNO | errno.ENOSYS
    refused = sorted(REFUSED[arch].values())
    n = len(refused)
    # layout: 0 ld arch | 1 jeq native | 2 ld nr | 3 jge x32 | 4..4+n-1 jeq refused | clone | clone3 | allow
    #         | eperm | enosys | clone flags: ld arg0 | jset -> eperm | allow | eperm
    base = 4
    ret_eperm, ret_enosys, flags = base + n + 3, base + n + 4, base + n + 5  # allow: base + n + 2
    prog = [
        _op(LD_W_ABS, OFFSET_ARCH),
        _op(JEQ_K, AUDIT_ARCH[arch], 0, ret_enosys - 2),
        _op(LD_W_ABS, OFFSET_NR),
        _op(JGE_K, X32_SYSCALL_BIT, ret_enosys - 4, 0),
    ]
    for i, nr in enumerate(refused):
        prog.append(_op(JEQ_K, nr, ret_eperm - (base + i) - 1, 0))
    prog.append(_op(JEQ_K, CLONE[arch], flags - (base + n) - 1, 0))
    prog.append(_op(JEQ_K, CLONE3, ret_enosys - (base + n + 1) - 1, 0))
    prog += [_op(RET_K, RET_ALLOW), _op(RET_K, eperm), _op(RET_K, enosys)]
    prog += [_op(LD_W_ABS, OFFSET_ARG0), _op(JSET_K, CLONE_NEW_FLAGS, 1, 0), _op(RET_K, RET_ALLOW), _op(RET_K, eperm)]
    assert len(prog) == flags + 4
    return prog


def packed(arch: str | None = None) -> bytes:
    """The filter as struct sock_filter[] (what bwrap --seccomp reads, or prctl takes)."""
    return b"".join(struct.pack("=HBBI", *ins) for ins in program(arch))


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install() -> None:
    """Load the filter into this thread (and everything it starts from now on); OSError if the kernel refuses."""
    code = packed()
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
