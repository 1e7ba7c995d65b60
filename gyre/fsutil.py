"""File helpers shared across gyre: durable writes (the shard writer, the checkpointer), the lock that lets
one process at a time build a cache entry (task images, warm starts), and temporary directories that go
with the process however it leaves."""

from __future__ import annotations

import atexit
import fcntl
import functools
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory after a rename, so the new name survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def locked(path: Path, waiting: Callable[[], object] | None = None) -> Iterator[None]:
    """Held by one process at a time on this machine (an flock on `path`, made if missing): the others wait,
    calling `waiting` first when they must."""
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# Temporary directories of this process not removed yet, with the pid that made each: a rank leaves with
# os._exit (gyre.sched.launch.job.exit_now), which skips the finally of every thread still inside one (a
# session's proxy socket, a grading's copy of the workspace), and atexit hooks too. A forked child inherits
# the table and the hook, and must not remove its parent's directories as it leaves.
_TEMPORARY: dict[Path, int] = {}
_TEMPORARY_LOCK = threading.Lock()


@contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A new directory in TMPDIR, removed when the block ends, or before the process leaves inside it
    (`remove_temporary_dirs`)."""
    path = _made(prefix)
    try:
        yield path
    finally:
        with _TEMPORARY_LOCK:
            _TEMPORARY.pop(path, None)
        shutil.rmtree(path, ignore_errors=True)


def process_dir(prefix: str) -> Path:
    """A new directory in TMPDIR for the rest of this process, removed as it leaves (`remove_temporary_dirs`)."""
    return _made(prefix)


def remove_temporary_dirs() -> None:
    """Remove every directory this process made with `scratch_dir` and `process_dir` and has not removed yet:
    at its exit (an atexit hook) and before an os._exit."""
    with _TEMPORARY_LOCK:
        mine = [path for path, pid in _TEMPORARY.items() if pid == os.getpid()]
        for path in mine:
            del _TEMPORARY[path]
    for path in mine:
        shutil.rmtree(path, ignore_errors=True)


def _made(prefix: str) -> Path:
    _remove_at_exit()
    path = Path(tempfile.mkdtemp(prefix=prefix))
    with _TEMPORARY_LOCK:
        _TEMPORARY[path] = os.getpid()
    return path


@functools.cache
def _remove_at_exit() -> None:
    atexit.register(remove_temporary_dirs)
