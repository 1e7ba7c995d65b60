"""Large request bodies are measured in helper processes before the proxy parses them.

Parsing JSON holds the GIL for the whole call (131K tiny messages: ~0.1-0.5 s; 60K tools: ~0.6 s), so no
thread of the proxy's process can do it without stalling the event loop. A body of LARGE_BODY_BYTES or
more goes to a helper (this file run as a script, reading frames on stdin) that parses it and
answers only its shape: its numbers of messages, tools and JSON values. The proxy refuses from those
numbers (too long for the context, or too many values to parse) and parses in its own process only what
passed, which is then small in values. Helpers are started on first use and end with the proxy (their
stdin closes).
"""

from __future__ import annotations

import contextlib
import json
import queue
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

import pydantic_core

LARGE_BODY_BYTES = 512 << 10
_LENGTH = struct.Struct("<Q")


@dataclass(frozen=True)
class BodyShape:
    messages: int = 0
    tools: int = 0
    values: int = 0
    error: str = ""  # not JSON: what the parser said


def count_values(value: Any) -> int:
    """Every JSON value in `value`, itself included (iterative: nesting is already bounded by the parser)."""
    count, stack = 0, [value]
    while stack:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


def shape_of(raw: bytes, max_items: int) -> BodyShape:
    """The body's shape; its values are counted only when its messages and tools number under `max_items`
    (over it the proxy refuses from the counts alone)."""
    try:
        body = pydantic_core.from_json(raw, cache_strings="keys")
    except ValueError as e:
        return BodyShape(error=str(e))
    if not isinstance(body, dict):
        return BodyShape(values=1)
    messages, tools = body.get("messages"), body.get("tools")
    n_messages = len(messages) if isinstance(messages, list) else 0
    n_tools = len(tools) if isinstance(tools, list) else 0
    values = count_values(body) if n_messages + n_tools < max_items else 0
    return BodyShape(n_messages, n_tools, values)


class _Helper:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", __file__],  # isolated: imports only the standard library and pydantic_core
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )

    def ask(self, raw: bytes, max_items: int) -> BodyShape:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(_LENGTH.pack(max_items) + _LENGTH.pack(len(raw)) + raw)
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise OSError(f"the body-check helper exited ({self.proc.poll()})")
        return BodyShape(**json.loads(line))

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):  # a dead helper's pipe cannot take what was buffered
                self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class BodyChecker:
    """Up to `size` helper processes; `shape` blocks (call it from a worker thread, not the event loop)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._idle: queue.Queue[_Helper] = queue.Queue()
        self._started = 0
        self._lock = threading.Lock()
        self._all: list[_Helper] = []

    def warm(self) -> None:
        """Start one helper now (an interpreter takes ~0.1-1 s to start), so the first large body need not wait."""
        with self._lock:
            if self._started == 0:
                self._started = 1
                helper = _Helper()
                self._all.append(helper)
                self._idle.put(helper)

    def _take(self) -> _Helper:
        with self._lock:
            if self._idle.empty() and self._started < self.size:
                self._started += 1
                helper = _Helper()
                self._all.append(helper)
                return helper
        return self._idle.get()

    def shape(self, raw: bytes, max_items: int) -> BodyShape:
        """The shape of `raw`; OSError or ValueError when the helper died (a fresh one takes its place)."""
        helper = self._take()
        try:
            return helper.ask(raw, max_items)
        except (OSError, ValueError):
            helper.close()
            helper = _Helper()
            with self._lock:
                self._all.append(helper)
            raise
        finally:
            self._idle.put(helper)

    def close(self) -> None:
        with self._lock:
            helpers, self._all, self._started = self._all, [], 0
        for helper in helpers:
            helper.close()
        self._idle = queue.Queue()


def _serve() -> None:
    """The helper: frames of (max items, length, body) on stdin, one JSON shape per line on stdout."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while header := stdin.read(2 * _LENGTH.size):
        if len(header) < 2 * _LENGTH.size:
            return
        max_items, length = _LENGTH.unpack(header[:8])[0], _LENGTH.unpack(header[8:])[0]
        shape = shape_of(stdin.read(length), max_items)
        stdout.write(json.dumps(shape.__dict__).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    _serve()
