"""Least-loaded engine choice over a set of engine URLs that can change while requests run.

The elastic scheduler calls `set_engines` from its own thread when cells switch roles; the proxy's
event loop calls `acquire`/`release` around each engine request.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class EngineRouter:
    def __init__(self, urls: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self.set_engines(urls)

    def set_engines(self, urls: Iterable[str]) -> None:
        """Replace the engine set; requests already running on a removed engine finish there."""
        new = [u.rstrip("/") for u in urls]
        with self._lock:
            self._in_flight = {u: self._in_flight.get(u, 0) for u in dict.fromkeys(new)}

    def engines(self) -> list[str]:
        with self._lock:
            return list(self._in_flight)

    def in_flight(self) -> dict[str, int]:
        with self._lock:
            return dict(self._in_flight)

    def acquire(self, exclude: Iterable[str] = ()) -> str | None:
        """The engine with the fewest in-flight requests (not in `exclude`), counted as busy; None if none."""
        skip = set(exclude)
        with self._lock:
            candidates = [u for u in self._in_flight if u not in skip]
            if not candidates:
                return None
            url = min(candidates, key=lambda u: self._in_flight[u])
            self._in_flight[url] += 1
            return url

    def release(self, url: str) -> None:
        with self._lock:
            if self._in_flight.get(url, 0) > 0:
                self._in_flight[url] -= 1
