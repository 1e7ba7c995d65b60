"""Run a command between it and Slurm's PMI-1 server, so that every request it sends fits the one read Slurm
gives it: `python -m gyre.sched.launch.pmi_relay -- CMD...` (the Slurm script puts it before each cell rank
when the step's `--mpi` is not PMIx; launch/slurm/sbatch.py).

Slurm's mpi/pmi2 plugin serves the PMI-1 wire protocol that the pip MPICH speaks, and reads each request with a
single read() of 1,024 bytes (src/plugins/mpi/pmi2/pmi1.c, "TODO: read until newline"), while it tells the client
`vallen_max=1024`. MPICH cuts a long value into segments of (vallen_max - 2) / 2 bytes, hex-encoded (runs of
zeros compressed), so a `cmd=put kvsname=... key=-allgather-1-3-seg-1/9 value=...` request reaches ~1,080 bytes
when its bytes do not compress. Its ucx module publishes 4,096 bytes from its worker address on (MPICH's own
"FIXME: use the actual addrname_len rather than MPID_MAX_BC_SIZE"), most of them whatever lies beyond that address
on the heap, so whether a start works depends on the machine and the run: a CI run lost all three starts to it
(Slurm: "value not properly terminated", then "request not begin with 'cmd='"; the rank hangs or aborts in
MPI_Init). The relay answers MPICH's `get_maxes` with a `vallen_max` whose requests always fit, and hands each
request on in one write. Anything that is not PMI-1 (a PMI-2 client) passes through untouched.

MPICH also names the shared memory its ranks on a node meet in after the kvsname (`/dev/shm/mpich_shm_%x_%d`, the
FNV hash of the kvsname and the node's index: src/mpid/ch4/shm/posix/posix_init.c), and Slurm's kvsname is
JOBID.STEPID: the same again after a requeue, and on any cluster whose job ids start over (the local test clusters
all start at 100000). A world that dies in or after MPI_Init leaves its segments behind, and the next world of that
name opens them instead of its own: with a segment sized for fewer ranks every start fails ("MPIDI_POSIX_comm_
bootstrap: Out of memory"; a two-host test lost its three starts to segments an earlier cluster on the machine
left). The relay hands MPICH the kvsname with the start's GYRE_WORLD_NONCE (set by the script for each start)
appended; Slurm ignores the kvsname a client sends back (pmi1.c: "not used").

The relay stays for the command's life (MPICH speaks PMI again at finalize), ignores the signals Slurm sends the
whole step (the command gets them itself) and exits as the command did."""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import signal
import socket
import subprocess
import sys

SLURM_READ = 1024  # the bytes Slurm's PMI-1 server reads per request
# the longest request line besides the value: "cmd=put kvsname=" + kvsname + " key=" + key + " value=" + "\n", with
# Slurm's kvsname (job.step, under 32) and MPICH's keys (under 50: "-allgather-shm-%d-%d-seg-%d/%d")
REQUEST_OVERHEAD = 128
VALLEN_MAX = SLURM_READ - REQUEST_OVERHEAD  # MPICH's segments then hex-encode to at most VALLEN_MAX - 2 characters
STEP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT)
WORLD_NONCE_VAR = "GYRE_WORLD_NONCE"  # the same for every rank of a start, another for each start (the script's)
_MAXES = re.compile(rb"^(cmd=maxes\b.*\bvallen_max=)(\d+)", re.MULTILINE)
_KVSNAME = re.compile(rb"^(cmd=my_kvsname\b.*\bkvsname=)(\S+)", re.MULTILINE)


def cap_maxes(line: bytes) -> bytes:
    """Slurm's answer to `get_maxes`, with vallen_max lowered to VALLEN_MAX; other lines unchanged."""
    return _MAXES.sub(lambda m: m[1] + str(min(int(m[2]), VALLEN_MAX)).encode(), line)


def name_world(line: bytes, nonce: bytes) -> bytes:
    """Slurm's answer to `get_my_kvsname`, its JOBID.STEPID followed by `.nonce` (none: unchanged); other lines
    unchanged."""
    return _KVSNAME.sub(lambda m: m[1] + m[2] + b"." + nonce, line) if nonce else line


PMI1_INIT = b"cmd=init pmi_version=1"


class Pmi1Lines:
    """Requests from the client, cut into what Slurm must read at once: one line, or a whole `mcmd=` block
    (up to `endcmd`), each handed on in one write. A client whose first bytes are not PMI-1's init (a PMI-2
    client's length-prefixed messages) has its bytes passed on as they come."""

    def __init__(self) -> None:
        self.buf = b""
        self.mode = "detect"  # -> "pmi1" or "raw"

    def feed(self, data: bytes) -> list[bytes]:
        self.buf += data
        if self.mode == "detect":
            if not PMI1_INIT.startswith(self.buf[: len(PMI1_INIT)]):
                self.mode = "raw"
            elif len(self.buf) >= len(PMI1_INIT):
                self.mode = "pmi1"
        if self.mode == "raw":
            out, self.buf = [self.buf], b""
            return out
        if self.mode == "detect":
            return []
        out = []
        while True:
            end = b"endcmd\n" if self.buf.startswith(b"mcmd=") else b"\n"
            i = self.buf.find(end)
            if i < 0:
                return out
            out.append(self.buf[: i + len(end)])
            self.buf = self.buf[i + len(end) :]


class Replies:
    """Slurm's replies, passed on line by line with `get_maxes`'s answer capped (cap_maxes) and the kvsname made
    the start's own (name_world)."""

    def __init__(self, nonce: bytes = b"") -> None:
        self.buf = b""
        self.nonce = nonce

    def feed(self, data: bytes) -> bytes:
        self.buf += data
        i = self.buf.rfind(b"\n")
        if i < 0:
            return b""
        done, self.buf = self.buf[: i + 1], self.buf[i + 1 :]
        return name_world(cap_maxes(done), self.nonce)


def relay(client: socket.socket, slurm: socket.socket, child: subprocess.Popen, nonce: bytes = b"") -> None:
    requests, replies = Pmi1Lines(), Replies(nonce)
    sel = selectors.DefaultSelector()
    sel.register(client, selectors.EVENT_READ)
    sel.register(slurm, selectors.EVENT_READ)
    while sel.get_map():
        for key, _ in sel.select(timeout=0.5):
            data = key.fileobj.recv(65536)
            if not data:  # one side closed. Slurm is never told: an EOF before `init` is fatal to its step daemon
                sel.unregister(key.fileobj)
                if key.fileobj is slurm:
                    with contextlib.suppress(OSError):
                        client.shutdown(socket.SHUT_WR)
                continue
            try:
                if key.fileobj is client:
                    for request in requests.feed(data):
                        slurm.sendall(request)
                else:
                    client.sendall(data if requests.mode == "raw" else replies.feed(data))
            except OSError:  # the other side is gone (the command died mid-request): what it sent goes nowhere
                sel.unregister(key.fileobj)
        if child.poll() is not None and not sel.select(timeout=0):
            return


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m gyre.sched.launch.pmi_relay -- CMD [ARG...]", file=sys.stderr)
        return 2
    if "PMI_FD" not in os.environ:  # not under Slurm's PMI (a PMIx step, or a plain run): nothing to relay
        os.execvp(argv[0], argv)
    slurm = socket.socket(fileno=int(os.environ["PMI_FD"]))
    client, theirs = socket.socketpair()
    for sig in STEP_SIGNALS:  # a handler, not SIG_IGN: the command starts with the default dispositions
        signal.signal(sig, lambda *_: None)
    child = subprocess.Popen(argv, env={**os.environ, "PMI_FD": str(theirs.fileno())}, pass_fds=(theirs.fileno(),))
    theirs.close()
    relay(client, slurm, child, re.sub(r"[^0-9A-Za-z_-]", "", os.environ.get(WORLD_NONCE_VAR, "")).encode())
    code = child.wait()
    if code < 0:  # killed by a signal: end the same way, so that Slurm reports what happened to the rank
        if -code in STEP_SIGNALS:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
