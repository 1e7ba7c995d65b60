"""Rollout-scoped API keys: the only way the proxy learns which rollout a call belongs to.

Each rollout gets a random key (`issue`) that the proxy maps to its rollout id; the key is revoked
when the rollout ends. A key the proxy never issued, or one whose rollout has ended, is refused, so
a harness can neither guess a sibling's id nor reuse a key past its rollout. Thread-safe: the runner
issues and revokes from its loop, the proxy resolves from its own.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Mapping

KEY_PREFIX = "gyre-rk-"


class KeyRefused(Exception):
    """Why a presented key does not name a running rollout."""


class RolloutKeys:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, str] = {}
        self._ended: set[str] = set()

    def issue(self, rollout_id: str) -> str:
        """A fresh key for `rollout_id`; a key it held before (a rerun session) stops being valid."""
        with self._lock:
            for old in [k for k, rid in self._live.items() if rid == rollout_id]:
                self._ended.add(old)
                del self._live[old]
            key = KEY_PREFIX + secrets.token_urlsafe(24)
            self._live[key] = rollout_id
            return key

    def revoke(self, key: str) -> None:
        with self._lock:
            if self._live.pop(key, None) is not None:
                self._ended.add(key)

    def rollout_of(self, keys: list[str]) -> str:
        """The rollout id the first live key of `keys` belongs to; KeyRefused when none is live."""
        with self._lock:
            for key in keys:
                if key in self._live:
                    return self._live[key]
            if any(key in self._ended for key in keys):
                raise KeyRefused("this API key belonged to a rollout that has ended; keys are not reused")
        raise KeyRefused("no valid API key: every call needs its rollout's key (Authorization: Bearer or x-api-key)")

    def live(self) -> int:
        with self._lock:
            return len(self._live)


def presented_keys(headers: Mapping[str, str]) -> list[str]:
    """The keys a request carries: `Authorization: Bearer <key>` (OpenAI) and `x-api-key` (Anthropic)."""
    keys = []
    auth = headers.get("Authorization") or ""
    if auth[:7].lower() == "bearer ":
        keys.append(auth[7:].strip())
    if headers.get("x-api-key"):
        keys.append(headers["x-api-key"].strip())
    return keys
