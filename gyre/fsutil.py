"""File helpers shared across gyre: durable writes (the shard writer, the checkpointer) and the lock that lets
one process at a time build a cache entry (task images, warm starts)."""

from __future__ import annotations

import fcntl
import os
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
