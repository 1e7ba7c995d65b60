"""Running a task's tests over the agent's code, from inside a checker. Standard library only.

The tests of a Harbor task or a SWE-bench instance import and run what the agent wrote, so whatever
they do belongs to the agent, and must end in a grade it earned:
- tests that run past their time are a failure of the code (score 0), never a checker that times out:
  that grade is excluded from training, and a losing agent could choose it;
- tests killed by a signal are the agent's doing too: only its code ran beside them;
- a process the tests leave behind could rewrite the reward file after the tests wrote it, so none
  may outlive them: in a sandbox with its own PID namespace (every isolated backend) each process but
  the checker and its ancestors is ended once the tests are done, and finding any scores the run 0.
  Without one, the tests' own process group is swept (a process that left it is out of reach there).
Each case is reported as an agent failure with its reason code (gyre.tasks.grading.AGENT_FAILURES).

The report channel: a checker tells the host what happened over a Unix socket it connects itself (not
inheritable, so no process it starts holds it; the checker is non-dumpable, so agent code of the same
user cannot open it through /proc either). `agent_code_starts()` says, before the agent's code first
runs, that from now on every abnormal end is the agent's doing; `report_verdict` carries the result;
`evaluation_broken` says the evaluation broke on its own (excluded). Outside grading (the harness's
visible self-check) there is no channel and these do nothing but exit where they say so.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, NamedTuple, NoReturn

KILL_WAIT_S = 2.0
AGENT_CODE_STARTS, VERDICT, BROKEN = "agent_code_starts", "verdict", "broken"  # report channel messages
EVALUATION_BROKEN_EXIT = 3
_report: socket.socket | None = None
_agent_code_started = False


def open_report(path: str, nonce: str) -> None:
    """Connect the report channel (the grading boot does, before the checker's own code runs)."""
    global _report
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # close-on-exec: no child inherits it
    sock.connect(path)
    sock.sendall(nonce.encode() + b"\n")
    _report = sock


def _send(kind: str, payload: str = "") -> None:
    if _report is not None:
        _report.sendall(json.dumps({"kind": kind, "payload": payload}).encode() + b"\n")


def agent_code_starts() -> None:
    """Say, before any of the agent's code runs, that every abnormal end from now on is the agent's doing.
    Sent once and in full before returning, so a checker killed right after has still said it."""
    global _agent_code_started
    if not _agent_code_started:
        _send(AGENT_CODE_STARTS)
        _agent_code_started = True


def report_verdict(text: str) -> None:
    """The checker's output (its last line is the result) to the host."""
    _send(VERDICT, text)


def evaluation_broken(reason: str) -> NoReturn:
    """End the checker: the evaluation broke on its own (a broken task, not the agent), excluded from training."""
    _send(BROKEN, reason)
    sys.stderr.write(reason + "\n")
    raise SystemExit(EVALUATION_BROKEN_EXIT)


class TestsRun(NamedTuple):  # not a dataclass: every checker imports this file (dataclasses costs ~8 ms)
    returncode: int | None  # None: killed at the time limit
    leftovers: int  # processes still running once the tests had ended (all ended since)
    timeout_s: float

    def agent_failure(self) -> str | None:
        """'code: detail' when the run itself scores 0, else None."""
        if self.returncode is None:
            return f"tests_timeout: the tests ran past {self.timeout_s:g}s"
        if self.returncode < 0:
            return f"tests_killed: the tests died of signal {-self.returncode}"
        if self.leftovers:
            return f"tests_left_processes: {self.leftovers} process(es) outlived the tests"
        return None


def run_tests(
    argv: Sequence[str] | str,
    *,
    cwd: str,
    env: Mapping[str, str] | None,
    timeout_s: float,
    out: IO[bytes],
    pid_namespace: bool,
    pass_fds: Sequence[int] = (),
    started: Callable[[subprocess.Popen[bytes]], None] | None = None,
) -> TestsRun:
    """Run the tests with `out` as their stdout and stderr (a file, never a pipe a child could hold open);
    `started(proc)` runs as soon as they are started (a handshake with descriptors of `pass_fds`): the tests
    then wait for it, and it says agent_code_starts() before it lets them go on."""
    if started is None:
        agent_code_starts()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                            shell=isinstance(argv, str), start_new_session=True, pass_fds=pass_fds)  # fmt: skip
    if started is not None:
        try:
            started(proc)
        except BaseException:
            _kill_group(proc.pid)
            raise
    try:
        returncode: int | None = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        returncode = None
        _kill_group(proc.pid)
        proc.wait()
    leftovers = _end_all_but_us() if pid_namespace else _end_group(proc.pid)
    return TestsRun(returncode, leftovers, timeout_s)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of a live process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[2])


def _live_pids() -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[0] not in ("Z", "X"):
                pids.append(int(name))
    return pids


def _ancestors() -> set[int]:
    pid, chain = os.getpid(), set()
    while pid > 0 and pid not in chain:
        chain.add(pid)
        st = _stat(pid)
        pid = st[1] if st else 0
    return chain


def _sweep(select: object) -> int:
    """SIGKILL every live process `select(pid)` picks until none is left; how many there were."""
    seen: set[int] = set()
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline:
        found = [pid for pid in _live_pids() if select(pid)]  # type: ignore[operator]
        if not found:
            break
        for pid in found:
            seen.add(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    return len(seen)


def _end_all_but_us() -> int:
    ours = _ancestors()
    return _sweep(lambda pid: pid not in ours and pid != 1)


def _end_group(pgid: int) -> int:
    return _sweep(lambda pid: (st := _stat(pid)) is not None and st[2] == pgid)
