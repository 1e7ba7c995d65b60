"""What a run shows a person: the progress bar's postfix after each step and the closing summary line.

Pure functions of metrics rows (gyre.sched.controller.steps.StepBook.summary); the controller prints them for every
scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gyre.health import success_over


def step_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of completed steps among metrics.jsonl's (its event rows left out; rows written before
    events shared the file carry no "event")."""
    return [r for r in rows if r.get("event", "step") == "step" and "step" in r]


def progress(row: dict[str, Any]) -> dict[str, str]:
    """The progress bar's postfix: reward and success over the scored rollouts, and what was not scored."""
    scored = bool(row.get("n_scored"))
    return {
        "reward": f"{row['reward_mean']:.2f}" if scored else "-",
        "success": f"{row['success_rate']:.2f}" if scored else "-",
        "excluded": f"{row['n_excluded']}/{row['n_rollouts']}",
        "timeouts": str(row["n_timeouts"]),
    }


def summary(
    rows: list[dict[str, Any]],
    out: Path,
    skipped: dict[str, str] | None = None,
    eval_rows: list[dict[str, Any]] | None = None,
) -> str:
    """Success over the first and the last quarter of the steps, held-out pass@1 at the first and the last
    eval, the suite's skipped tasks, the outputs."""
    k = max(1, len(rows) // 4)
    skipped_text = "".join(f"gyre: task {name} skipped: {cause}\n" for name, cause in sorted((skipped or {}).items()))

    def rate(rs: list[dict[str, Any]]) -> str:
        value, n = success_over(rs)
        excluded = sum(int(r.get("n_excluded", 0)) for r in rs)
        shown = "n/a" if value is None else f"{value:.2f}"
        return f"{shown} over the {{}} {k} steps ({n} rollouts scored, {excluded} excluded)"

    return (
        f"gyre: success rate {rate(rows[:k]).format('first')} -> {rate(rows[-k:]).format('last')}\n"
        f"{held_out_line(eval_rows or [])}{skipped_text}gyre: outputs in {out}"
    )


def held_out_line(eval_rows: list[dict[str, Any]]) -> str:
    """Held-out pass@1 (and pass@k at the largest k) of the first and the last eval, with their versions."""
    if not eval_rows:
        return ""

    def shown(r: dict[str, Any]) -> str:
        k = max((int(key[5:]) for key in r if key.startswith("pass@")), default=1)
        p1, pk = r.get("pass@1"), r.get(f"pass@{k}")
        text = "n/a" if p1 is None else f"{p1:.2f}"
        if k > 1 and pk is not None:
            text += f" (pass@{k} {pk:.2f})"
        return f"{text} at version {r['version']}"

    first, last = eval_rows[0], eval_rows[-1]
    n = f"{last['n_tasks']} tasks x {last['n_samples'] // max(1, last['n_tasks'])} samples, {last['excluded']} excluded"
    return f"gyre: held-out pass@1 {shown(first)} -> {shown(last)} ({n})\n"
