"""The scheduler benchmark's defences against a busy machine: rotated interleaving, medians with their
range, paired speedups, CPU seconds per component."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tools.bench_schedulers import (
    component_of,
    paired_speedups,
    process_tree,
    report,
    run_order,
    same_work,
    sampled_tokens,
    spread,
)

pytestmark = pytest.mark.unit


def test_each_scheduler_runs_first_middle_and_last_equally_often() -> None:
    scheds = ["colocate_cells", "async", "elastic"]
    orders = [run_order(scheds, r) for r in range(3)]
    assert orders[0] == scheds and all(sorted(o) == sorted(scheds) for o in orders)
    for position in range(3):  # a Latin square: each scheduler once in each position
        assert sorted(o[position] for o in orders) == sorted(scheds)


def test_speedups_pair_the_runs_of_one_repeat() -> None:
    """A load burst in repeat 1 slows every scheduler of that repeat alike: the paired ratios stay 1.5
    where the ratio of medians would not."""
    walls = {"elastic": [100.0, 300.0, 110.0], "async": [150.0, 450.0, 165.0]}
    results = {s: [{"wall_s": w} for w in ws] for s, ws in walls.items()}
    assert paired_speedups(results) == {"async": {"median": 1.5, "min": 1.5, "max": 1.5}}
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}


def test_report_gives_medians_with_their_spread() -> None:
    def run(wall: float) -> dict:
        return {"wall_s": wall, "job_s": wall + 5, "final_reward": 0.5, "mean_reward": 0.4, "recomputed_tokens": 0,
                "switch_s": {"rollout->train": [1.0], "train->rollout": []}, "would_recompute_tokens": 0,
                "continued_calls": 0, "migrated_idle_sessions": 0, "same_engine_followups": 1.0, "bound_s": 50.0,
                "cpu_s": {"controller": wall / 10, "cell1": 1.0}, "sampled": {"s0-g0-r0": "a", "s0-g0-r1": "b"}}  # fmt: skip

    table = report({"elastic": [run(100), run(90), run(120)], "async": [run(200), run(150), run(180)]})
    assert table["elastic"]["wall_spread_s"] == {"median": 100.0, "min": 90.0, "max": 120.0}
    assert table["elastic"]["cpu_s"]["controller"] == {"median": 10.0, "min": 9.0, "max": 12.0}
    assert table["elastic"]["over_bound"] == 2.0  # the median of each run's wall over its own bound
    assert table["elastic_speedup_vs_async"] == 1.667  # the median of 2.0, 1.667, 1.5
    assert table["elastic_speedup_vs_async_spread"] == {"median": 1.667, "min": 1.5, "max": 2.0}
    assert table["same_work"] == 1.0


def test_same_work_compares_the_tokens_each_rollout_sampled(tmp_path) -> None:
    """Two runs did the same work where each rollout's calls sampled the same tokens in the same order; the
    call ids (the order calls arrived in the run) do not count."""

    def calls(path, rows):
        path.write_text(
            "".join(json.dumps({"rollout_id": r, "call_id": i, "output_ids": ids}) + "\n" for r, i, ids in rows)
        )
        return sampled_tokens(path)

    first = calls(tmp_path / "a.jsonl", [("r0", 1, [5, 6]), ("r1", 2, [7]), ("r0", 3, [8])])
    same = calls(tmp_path / "b.jsonl", [("r1", 1, [7]), ("r0", 2, [5, 6]), ("r0", 7, [8])])
    swapped = calls(tmp_path / "c.jsonl", [("r0", 1, [8]), ("r1", 2, [7]), ("r0", 3, [5, 6])])
    assert same == first and swapped["r1"] == first["r1"] and swapped["r0"] != first["r0"]
    runs = {"colocate_cells": [{"sampled": first}, {"sampled": same}], "elastic": [{"sampled": swapped}]}
    assert same_work(runs) == round(5 / 6, 4)  # of 6 rollouts over 3 runs, one went its own way


def test_cpu_seconds_are_told_apart_by_component() -> None:
    job = "python -m mpi4py -m gyre.sched.launch.job out"
    assert component_of("mpirun -n 4", "", "launcher") == "launcher"
    assert component_of(f"sh -c trap '' USR1; {job}", "0", "launcher") == "controller"  # the rank's shell
    assert component_of(job, "0", "controller") == "controller"
    assert component_of(job, "2", "cell@rank2") == "cell@rank2"
    assert component_of("python -m gyre.engine.server --port 1", "2", "cell@rank2") == "engine@rank2"
    assert component_of("python -m gyre.engine.server --port 1", "", "cell@rank2") == "engine@rank2"
    assert component_of("bwrap -- python harness.py", "", "controller") == "harnesses"  # no PMI_RANK inside
    assert component_of("python grade.py", "", "harnesses") == "harnesses"
    tree = process_tree(os.getpid())  # this test's process, no MPI rank: the launcher
    assert tree[os.getpid()][0] == "launcher" and tree[os.getpid()][1] > 0


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--steps", "0"], "--steps and --repeats must be at least 1"),
        (["--repeats", "-1"], "--steps and --repeats must be at least 1"),
        (["--schedulers", "async,fifo"], "--schedulers: no fifo (the cell schedulers are"),
        (["--schedulers", "async,async"], "--schedulers names one twice"),
        (["--only", "elastic"], "unrecognized arguments: --only (extra arguments are key=value overrides"),
    ],
)
def test_values_out_of_domain_are_refused_before_any_run(
    argv: list[str], said: str, tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tools import bench_schedulers

    monkeypatch.setattr(sys, "argv", ["bench_schedulers", "--out", str(tmp_path / "out"), *argv])
    with pytest.raises(SystemExit) as stop:
        bench_schedulers.main()
    assert stop.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
