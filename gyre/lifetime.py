"""Child processes that die with the process that started them, even when it is SIGKILLed: a crashed run
leaves no engine, proxy helper or harness behind holding ports, memory and GPUs.

Linux's PR_SET_PDEATHSIG signals a child when its parent *thread* exits, not its parent process. So:
- `spawn_tied` forks from one thread that lives as long as this process: for children that outlive the
  thread that asked for them (an engine a cell's thread starts, restarted later from another thread);
- `tied_to_this_thread` ties children the starting thread waits on anyway (a harness, a checker: the thread
  outlives them unless the process dies) by the command they run: `env` gives the signals below their
  default action, `setpriv` arms the signal, a shell kills the child if its parent already died, then it
  execs the command. Without a preexec_fn, Popen can vfork: forking a large process (a controller with torch
  and its buffers, 600 MB) for each of a run's hundreds of sandboxes took 15 ms of CPU and 33 ms of its event
  loop's time each; the three execs take about 2.5 ms of the child's. Where `setpriv --pdeathsig` or
  `env --default-signal` is missing, `tie_to_this_thread`, the same as a `preexec_fn`.
`pid_alive` tells whether a process still runs (a zombie does not). Every tying function arms the signal in the
child before it execs the command and kills the child at once if its parent already died
(the race the kernel leaves open), and gives the child the default action of the signals a run is stopped
or attacked with: an ignored signal survives exec, so a run started under `nohup` (SIGHUP) or as a shell's
background job (SIGINT, SIGQUIT) would otherwise hand that to every engine, harness and checker. Elsewhere
than Linux each is a plain Popen.
"""

from __future__ import annotations

import ctypes
import functools
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

PR_SET_PDEATHSIG = 1
# resolved once, here: a preexec_fn runs between fork and exec, where loading a library could deadlock
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
_prctl = _libc.prctl if _libc is not None else None
if _libc is not None:
    _libc.signal.argtypes, _libc.signal.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
# reset to their default action in every tied child (see the module's docstring)
DEFAULT_ACTION = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2,
                  signal.SIGALRM)  # fmt: skip


def tie_to_this_thread(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A preexec_fn: the child gets `sig` when the calling thread (or this process) ends; None off Linux."""
    if _prctl is None:
        return None
    parent = os.getpid()

    def arm() -> None:
        for s in DEFAULT_ACTION:
            _libc.signal(int(s), None)  # SIG_DFL
        _prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # the parent died between fork and prctl: no signal will come
            os.kill(os.getpid(), sig)

    return arm


# sh -c CHECK PARENT_PID ARGV...: run after setpriv armed the signal; a parent that died before then sent none
_CHECK_PARENT = '[ "$PPID" = "$0" ] && exec "$@"; kill -s {sig} $$'


def tied_to_this_thread(argv: list[str], sig: int = signal.SIGTERM) -> tuple[list[str], Callable[[], None] | None]:
    """(argv, preexec_fn) for Popen: a child that gets `sig` when the calling thread (or this process) ends,
    its signals at their default action, tied by the command it runs (see the module's docstring)."""
    if _prctl is None:
        return argv, None
    tools = _exec_tie_tools()
    if tools is None:
        return argv, tie_to_this_thread(sig)
    return [*_tie_prefix(tools, sig), *argv], None


def _tie_prefix(tools: tuple[str, str, str], sig: int) -> list[str]:
    env, setpriv, sh = tools
    name = signal.Signals(sig).name.removeprefix("SIG")
    defaults = ",".join(s.name.removeprefix("SIG") for s in DEFAULT_ACTION)
    check = _CHECK_PARENT.format(sig=name)
    return [env, f"--default-signal={defaults}", setpriv, "--pdeathsig", name, "--", sh, "-c", check, str(os.getpid())]


@functools.cache
def _exec_tie_tools() -> tuple[str, str, str] | None:
    """(env, setpriv, sh) when the prefix they make runs a command here (coreutils >= 8.31 for
    `env --default-signal`, util-linux >= 2.33 for `setpriv --pdeathsig`), else None."""
    env, setpriv, sh = shutil.which("env"), shutil.which("setpriv"), shutil.which("sh")
    if env is None or setpriv is None or sh is None:
        return None
    found = (env, setpriv, sh)
    try:
        probe = subprocess.run([*_tie_prefix(found, signal.SIGTERM), "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return found if probe.returncode == 0 else None


class _Forker:
    """One daemon thread that forks every tied child and never exits before the process does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._pid = 0  # the process whose thread it is (a forked child has none until it asks)

    def call(self, fn: Callable[[], Any]) -> Any:
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                self._jobs = queue.SimpleQueue()
                threading.Thread(target=self._serve, args=(self._jobs,), name="gyre-forker", daemon=True).start()
            done: Future[Any] = Future()
            self._jobs.put((fn, done))
        return done.result()

    @staticmethod
    def _serve(jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]]) -> None:
        while True:
            fn, done = jobs.get()
            try:
                done.set_result(fn())
            except BaseException as e:  # the caller raises it
                done.set_exception(e)


_FORKER = _Forker()


def spawn_tied(argv: list[str], sig: int = signal.SIGTERM, **popen_kwargs: Any) -> subprocess.Popen:
    """subprocess.Popen(argv, **popen_kwargs) whose child gets `sig` when this process ends, however it ends,
    and not before, whichever thread calls this."""
    if _prctl is None:
        return subprocess.Popen(argv, **popen_kwargs)
    return _FORKER.call(lambda: subprocess.Popen(argv, preexec_fn=tie_to_this_thread(sig), **popen_kwargs))


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (Linux's /proc; False where there is none)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"
