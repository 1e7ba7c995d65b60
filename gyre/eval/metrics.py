"""The numbers an evaluation reports, from graded samples alone (pure: no run, no files).

pass@1 is the mean success over a task's graded samples; pass@k is the unbiased estimator of the Codex
paper (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"): with n graded samples of
a task of which c succeed, 1 - C(n-c, k) / C(n, k), the chance that k samples drawn without replacement
hold a success, in its product form (no large binomials). Each is averaged over tasks, so a task's weight
does not depend on how many of its samples were graded. Excluded samples (the grader failed: no verdict)
count in `excluded`, never as failures.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sample:
    """One eval rollout's verdict. `score` None: excluded (no grade)."""

    task_id: str
    family: str
    success: bool
    score: float | None


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k) for n samples with c successes, 1 <= k <= n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every draw of k holds a success
        return 1.0
    miss = 1.0  # C(n-c, k) / C(n, k) = prod_{i=n-c+1..n} (1 - k/i)
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def summarize(samples: Iterable[Sample], max_k: int) -> dict[str, Any]:
    """pass@1, pass@k (k = 2 .. max_k, over tasks with at least k graded samples), mean reward, the counts."""
    samples = list(samples)
    graded = [s for s in samples if s.score is not None]
    per_task = _per_task(graded)
    out: dict[str, Any] = {
        "n_tasks": len({s.task_id for s in samples}),
        "n_samples": len(samples),
        "excluded": len(samples) - len(graded),
        "mean_reward": _mean([float(s.score) for s in graded if s.score is not None]),
    }
    for k in range(1, max_k + 1):
        values = [pass_at_k(n, c, k) for n, c in per_task.values() if n >= k]
        out[f"pass@{k}"] = _mean(values)
    return out


def summarize_by_family(samples: Iterable[Sample], max_k: int) -> dict[str, dict[str, Any]]:
    """`summarize` of each family's samples (a suite's tasks share one family: the suite)."""
    by_family: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_family[s.family].append(s)
    return {family: summarize(group, max_k) for family, group in sorted(by_family.items())}


def task_table(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    """One row per task: its family, samples, graded, successes, pass@1, mean reward."""
    rows = []
    for task_id in sorted({s.task_id for s in samples}):
        mine = [s for s in samples if s.task_id == task_id]
        graded = [s for s in mine if s.score is not None]
        successes = sum(s.success for s in graded)
        rows.append({
            "task_id": task_id, "family": mine[0].family, "samples": len(mine), "graded": len(graded),
            "successes": successes, "pass@1": successes / len(graded) if graded else None,
            "mean_reward": _mean([float(s.score) for s in graded if s.score is not None]),
        })  # fmt: skip
    return rows


def _per_task(graded: Iterable[Sample]) -> dict[str, tuple[int, int]]:
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for s in graded:
        counts[s.task_id][0] += 1
        counts[s.task_id][1] += int(s.success)
    return {t: (n, c) for t, (n, c) in counts.items()}


def _mean(values: Sequence[float]) -> float | None:
    """None, not NaN, for nothing to average: metrics.jsonl stays strict JSON."""
    return sum(values) / len(values) if values else None
