"""The host end of a checker's report channel (the checker's end: gyre.tasks.agent_code).

Grading must tell apart an evaluation that broke on its own (excluded from training) from one the agent's
code broke (score 0): a checker's exit code cannot say which, since the agent's code, running as the
checker's child, can end or stop the checker with any signal it likes. So the checker reports over a
channel of its own: a Unix socket it connects before it runs anything, presenting a nonce it read from
its stdin. The listener takes the first connection that presents the nonce and then stops listening, so
nothing else can connect; the socket is not inheritable and the checker is non-dumpable, so no process
the checker starts can write to it. What it carries: "agent_code_starts" (sent in full before any of the
agent's code runs), then the verdict, or "broken" with the reason the evaluation broke.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from gyre.tasks.agent_code import AGENT_CODE_STARTS, BROKEN, VERDICT

NONCE_WAIT_S = 1.0  # a connection that does not present the nonce within this is dropped


@dataclass
class CheckerReport:
    agent_code_started: bool = False
    verdict: str | None = None  # the checker's captured stdout; its last line is the result
    broken: str | None = None  # why the evaluation broke, as the checker judged it


class ReportListener:
    """Listens at `path` for the checker's connection and reads its reports on a thread of its own."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.nonce = secrets.token_hex(16)
        self.report = CheckerReport()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen(4)
        self._thread = threading.Thread(target=self._serve, name="checker-report", daemon=True)
        self._thread.start()

    def finish(self, wait_s: float) -> CheckerReport:
        """The report once the checker has ended: its last messages are read for up to `wait_s`."""
        self._thread.join(wait_s)
        self._sock.close()
        return self.report

    def _serve(self) -> None:
        try:
            while True:
                conn, _ = self._sock.accept()
                with conn:
                    if self._read(conn):
                        return
        except OSError:  # the listener was closed: the checker has ended
            pass

    def _read(self, conn: socket.socket) -> bool:
        """True when `conn` was the checker's (its reports read to the end), False for any other."""
        conn.settimeout(NONCE_WAIT_S)
        stream = conn.makefile("rb")
        try:
            if stream.readline(len(self.nonce) + 2).strip() != self.nonce.encode():
                return False
        except OSError:
            return False
        self._sock.close()  # the checker is connected: nothing else may
        conn.settimeout(None)
        try:
            for line in stream:
                self._take(line)
        except OSError:
            pass
        return True

    def _take(self, line: bytes) -> None:
        try:
            message = json.loads(line)
            kind, payload = message["kind"], message["payload"]
        except (ValueError, KeyError, TypeError):
            return  # a line cut short when the checker died: no message
        if kind == AGENT_CODE_STARTS:
            self.report.agent_code_started = True
        elif kind == VERDICT:
            self.report.verdict = str(payload)
        elif kind == BROKEN:
            self.report.broken = str(payload)
