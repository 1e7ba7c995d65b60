"""pass@k and the eval summary against hand values and the Codex paper's reference formula."""

import math

import numpy as np
import pytest

from gyre.eval.metrics import Sample, pass_at_k, summarize, summarize_by_family, task_table

pytestmark = pytest.mark.unit


def reference_estimator(n: int, c: int, k: int) -> float:
    """The HumanEval repository's estimate_pass_at_k (numpy), as published with the paper."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def test_pass_at_k_hand_values():
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2)/C(4,2) = 3/6
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # C(3,3)/C(5,3)
    assert pass_at_k(4, 3, 2) == 1.0  # n - c < k


@pytest.mark.parametrize("n", [1, 2, 5, 10, 200])
def test_pass_at_k_matches_reference_and_binomials(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            got = pass_at_k(n, c, k)
            assert got == pytest.approx(reference_estimator(n, c, k), abs=1e-12)
            if n <= 10:
                assert got == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def samples() -> list[Sample]:
    a = [Sample("a", "f1", ok, 1.0 if ok else 0.5) for ok in (True, False, False, False)]
    b = [Sample("b", "f2", ok, 1.0 if ok else 0.0) for ok in (True, True, False)]
    return [*a, *b, Sample("b", "f2", False, None)]  # b's 4th sample: excluded, not a failure


def test_summary_averages_over_tasks_and_keeps_excluded_apart():
    s = summarize(samples(), max_k=4)
    assert s["n_tasks"] == 2 and s["n_samples"] == 8 and s["excluded"] == 1
    assert s["pass@1"] == pytest.approx((1 / 4 + 2 / 3) / 2)
    assert s["pass@2"] == pytest.approx((pass_at_k(4, 1, 2) + pass_at_k(3, 2, 2)) / 2)
    assert s["pass@4"] == pytest.approx(pass_at_k(4, 1, 4))  # only a has 4 graded samples
    assert s["mean_reward"] == pytest.approx((1 + 0.5 * 3 + 1 + 1 + 0) / 7)


def test_by_family_and_task_table():
    fam = summarize_by_family(samples(), max_k=2)
    assert set(fam) == {"f1", "f2"} and fam["f2"]["excluded"] == 1
    assert fam["f1"]["pass@1"] == pytest.approx(0.25)
    rows = task_table(samples())
    assert [(r["task_id"], r["samples"], r["graded"], r["successes"]) for r in rows] == [("a", 4, 4, 1), ("b", 4, 3, 2)]


def test_nothing_graded_gives_none_not_nan():
    s = summarize([Sample("a", "f", False, None)], max_k=2)
    assert s["pass@1"] is None and s["mean_reward"] is None and s["excluded"] == 1
