"""Engine choice over a set of engine URLs that can change while requests run: least-loaded, with
session affinity.

A session's calls extend its previous context, which the engine that served its last call holds in
its prefix cache: the next call goes back there unless that engine has `affinity_slack` more requests
in flight than the least-loaded one (then it goes there and prefills again). The elastic scheduler
calls `set_engines` from its own thread when cells switch roles; the proxy's event loop calls
`acquire`/`release` around each engine request.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class EngineRouter:
    def __init__(self, urls: Iterable[str] = (), affinity_slack: int = 2) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self.affinity_slack = affinity_slack  # < 0: no affinity
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

    def acquire(self, exclude: Iterable[str] = (), prefer: str | None = None, home: str | None = None) -> str | None:
        """An engine not in `exclude`, counted as busy (None if none): `prefer` if it is a candidate (a
        request's keys/values were moved there), else the session's `home` unless it is `affinity_slack`
        requests busier than the least-loaded engine, else the least-loaded one."""
        skip = set(exclude)
        with self._lock:
            candidates = [u for u in self._in_flight if u not in skip]
            if not candidates:
                return None
            least = min(candidates, key=lambda u: self._in_flight[u])
            near = self.affinity_slack >= 0 and home in candidates
            if prefer in candidates:
                url = prefer
            elif near and self._in_flight[home] <= self._in_flight[least] + self.affinity_slack:  # type: ignore[index]
                url = home  # type: ignore[assignment]
            else:
                url = least
            self._in_flight[url] += 1
            return url

    def release(self, url: str) -> None:
        with self._lock:
            if self._in_flight.get(url, 0) > 0:
                self._in_flight[url] -= 1
