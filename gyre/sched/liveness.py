"""Noticing within a second that a cell's rank is gone, on whatever host it runs.

Each cell's leader opens a TCP connection to the controller when it answers Hello, names its rank on
it, and then leaves it alone. When the rank's process ends, however it ends (SIGKILL, the OOM killer, a
crash in native code, srun ending the task), its kernel closes the connection and the controller reads
end-of-file on its next look, a fraction of a second later. Without this, a rank on another host was
declared dead only once it had owed an answer for `sched.cell_timeout_s` (120 s), the step it held a
micro-batch of stalled meanwhile (a rank on the controller's host is also seen through /proc:
gyre.lifetime.pid_alive). A host that vanishes without closing anything (power, network) is caught by
TCP keepalive after about KEEPALIVE_S, or by `sched.cell_timeout_s` when an answer is owed first.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterable

CONNECT_TIMEOUT_S = 10.0  # a cell's connect (the controller listens before it sends Hello)
IDENTIFY_TIMEOUT_S = 10.0  # the controller's wait for every cell's rank line after the Hello acks
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 10, 5, 3
KEEPALIVE_S = KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    ):
        if hasattr(socket, name):  # Linux; elsewhere the system's (hours)
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class LivenessWatch:
    """The controller's end: listens at `host`, learns which connection is which rank, reports closed ones."""

    def __init__(self, host: str) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family)
        self._listener.setblocking(False)
        port = self._listener.getsockname()[1]
        self.address = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        self._ranks: dict[socket.socket, int] = {}
        self._gone: set[int] = set()

    def identify(self, ranks: Iterable[int], timeout_s: float = IDENTIFY_TIMEOUT_S) -> list[int]:
        """Accept the cells' connections until every rank in `ranks` has named itself; returns those that did
        not within `timeout_s` (their death is then noticed only by the timeout)."""
        missing = set(ranks)
        pending: list[socket.socket] = []
        deadline = time.monotonic() + timeout_s
        while missing and (left := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([self._listener, *pending], [], [], min(left, 0.5))
            for sock in readable:
                if sock is self._listener:
                    conn, _ = self._listener.accept()
                    _keepalive(conn)
                    pending.append(conn)
                    continue
                pending.remove(sock)
                line = sock.recv(64).decode(errors="replace").strip()
                if not line.isdigit():  # not one of ours (or it died at once): let the timeout decide
                    sock.close()
                    continue
                self._ranks[sock] = int(line)
                missing.discard(int(line))
        for sock in pending:
            sock.close()
        return sorted(missing)

    def gone(self) -> set[int]:
        """Ranks whose connection has closed: their process has ended."""
        if self._ranks:
            readable, _, _ = select.select(list(self._ranks), [], [], 0)
            for sock in readable:
                try:
                    data = sock.recv(64)
                except OSError:  # reset, or keepalive gave up on a vanished host
                    data = b""
                if not data:
                    self._gone.add(self._ranks.pop(sock))
                    sock.close()
        return set(self._gone)

    def close(self) -> None:
        """Stop watching (before the cells are told to shut down, when every connection closes)."""
        for sock in [self._listener, *self._ranks]:
            sock.close()
        self._ranks.clear()


def connect(address: str, rank: int) -> socket.socket:
    """A cell leader's end: connect to the controller's watch and name this rank; keep the socket open for the
    life of the process (never inherited by children: Python's sockets are not inheritable)."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S)
    sock.sendall(f"{rank}\n".encode())
    return sock
