"""Runs that fail, fail loudly: a step whose rollouts were mostly excluded (infrastructure failures, not the
policy's) trains on nothing, so a run of such steps stops with the exclusion reasons counted.

Pure bookkeeping on step rows (gyre.sched.controller.steps.StepBook.summary); imports nothing heavy.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gyre.errors import UserError

_NUMBERS = re.compile(r"\d+")


class ExcludedRunError(UserError, RuntimeError):
    """Too many consecutive steps had too many excluded rollouts: the run cannot learn as configured."""


def reason_kind(reason: str) -> str:
    """An exclusion reason without what varies per rollout (counts, ports, ids), so like reasons count together."""
    head = reason.split(" (", 1)[0]
    return _NUMBERS.sub("N", head)[:200]


def count_reasons(reasons: Iterable[str]) -> list[list[Any]]:
    """[[reason kind, count], ...], most frequent first: JSON-ready, not a tracker scalar."""
    return [[k, n] for k, n in Counter(reason_kind(r) for r in reasons).most_common()]


def excluded_fraction(row: dict[str, Any]) -> float:
    n = int(row.get("n_rollouts", 0))
    return int(row.get("n_excluded", 0)) / n if n else 0.0


def step_failed(row: dict[str, Any], max_excluded_fraction: float) -> bool:
    """Every rollout excluded (nothing scored), or more than `max_excluded_fraction` of them."""
    n = int(row.get("n_rollouts", 0))
    return n > 0 and (int(row.get("n_scored", 0)) == 0 or excluded_fraction(row) > max_excluded_fraction)


@dataclass
class ExclusionWatch:
    """Counts consecutive failed steps (step_failed); the `max_steps`-th raises ExcludedRunError (0: never)."""

    max_excluded_fraction: float
    max_steps: int
    failed_rows: list[dict[str, Any]] = field(default_factory=list)

    def observe(self, row: dict[str, Any]) -> None:
        if not step_failed(row, self.max_excluded_fraction):
            self.failed_rows = []
            return
        self.failed_rows.append(row)
        if self.max_steps and len(self.failed_rows) >= self.max_steps:
            raise ExcludedRunError(self.message())

    def message(self) -> str:
        rows = self.failed_rows
        reasons: Counter[str] = Counter()
        for r in rows:
            for kind, n in r.get("excluded_reason_counts", []):
                reasons[kind] += int(n)
        steps = ", ".join(str(r.get("step")) for r in rows)
        excluded = sum(int(r.get("n_excluded", 0)) for r in rows)
        total = sum(int(r.get("n_rollouts", 0)) for r in rows)
        listed = "; ".join(f"{n}x {kind}" for kind, n in reasons.most_common()) or "no reason recorded"
        return (
            f"stopping: {len(rows)} step(s) in a row ({steps}) had more than rl.max_excluded_fraction="
            f"{self.max_excluded_fraction} of their rollouts excluded ({excluded} of {total}): {listed}. "
            f"Excluded rollouts train nothing; fix the cause (a harness whose requests exceed the context: "
            f"engine.max_context_tokens, proxy.max_context_tokens, model.max_position_embeddings), or raise "
            f"rl.max_excluded_fraction / rl.max_excluded_steps (0: never stop)"
        )


def success_over(rows: list[dict[str, Any]]) -> tuple[float | None, int]:
    """Success rate over the rows' scored rollouts (None when none was scored) and how many were scored."""
    n = sum(int(r.get("n_scored", 0)) for r in rows)
    if not n:
        return None, 0
    return sum(float(r["success_rate"]) * int(r["n_scored"]) for r in rows if r.get("n_scored")) / n, n
