"""Runs that fail, fail loudly: failed-step detection, the stop and its counted reasons, a summary without nan."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gyre.config.validate import ConfigValueError
from gyre.health import ExcludedRunError, ExclusionWatch, count_reasons, step_failed
from gyre.sched.controller.report import progress, summary

pytestmark = pytest.mark.unit


def row(step: int, n: int, excluded: int, success: float = 0.5, reasons: list | None = None) -> dict:
    return {
        "step": step, "n_rollouts": n, "n_scored": n - excluded, "n_excluded": excluded, "n_timeouts": 0,
        "reward_mean": math.nan if n == excluded else success, "success_rate": math.nan if n == excluded else success,
        "excluded_reason_counts": reasons or [],
    }  # fmt: skip


def test_reasons_are_counted_by_kind():
    reasons = [
        "infrastructure: proxy answered HTTP 504 to POST /v1/chat/completions (3 proxy failures; exit code 1)",
        "infrastructure: proxy answered HTTP 504 to POST /v1/chat/completions (4 proxy failures; exit code 1)",
        "sandbox could not start: bwrap: no permission",
    ]
    assert count_reasons(reasons) == [
        ["infrastructure: proxy answered HTTP N to POST /vN/chat/completions", 2],
        ["sandbox could not start: bwrap: no permission", 1],
    ]


def test_a_step_fails_when_all_or_too_many_rollouts_are_excluded():
    assert step_failed(row(0, 4, 4), 1.0)  # nothing scored fails whatever the fraction
    assert step_failed(row(0, 4, 3), 0.5) and not step_failed(row(0, 4, 2), 0.5)
    assert not step_failed(row(0, 0, 0), 0.0)  # no rollouts at all: nothing to judge


def test_the_watch_stops_after_consecutive_failed_steps_with_reasons():
    watch = ExclusionWatch(0.5, 2)
    bad = [["infrastructure: proxy unreachable", 4]]
    watch.observe(row(0, 4, 4, reasons=bad))
    watch.observe(row(1, 4, 0))  # a good step resets the count
    watch.observe(row(2, 4, 4, reasons=bad))
    with pytest.raises(ExcludedRunError) as e:
        watch.observe(row(3, 4, 3, reasons=[["infrastructure: proxy unreachable", 3]]))
    assert "2 step(s) in a row (2, 3)" in str(e.value) and "7x infrastructure: proxy unreachable" in str(e.value)
    assert "rl.max_excluded_fraction" in str(e.value) and "(7 of 8)" in str(e.value)
    never = ExclusionWatch(0.5, 0)
    for s in range(5):
        never.observe(row(s, 4, 4))


def test_summary_and_progress_never_show_nan():
    rows = [row(0, 4, 4), row(1, 4, 0, success=0.25), row(2, 4, 0, success=0.75), row(3, 4, 0, success=1.0)]
    text = summary(rows, Path("/out"))
    assert "nan" not in text
    assert "n/a over the first 1 steps (0 rollouts scored, 4 excluded)" in text
    assert "1.00 over the last 1 steps (4 rollouts scored, 0 excluded)" in text
    assert progress(rows[0]) == {"reward": "-", "success": "-", "excluded": "4/4", "timeouts": "0"}


def test_limits_are_checked():
    from gyre.config.schema import RLConfig

    with pytest.raises(ConfigValueError, match="rl.max_excluded_fraction"):
        RLConfig(max_excluded_fraction=1.5)
    with pytest.raises(ConfigValueError, match="rl.max_excluded_steps"):
        RLConfig(max_excluded_steps=-1)
