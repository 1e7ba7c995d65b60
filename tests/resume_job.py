"""The tiny main job that tests/test_resume.py and tests/test_slurm_requeue.py stop and resume.

Its warm start is just good enough for some rollouts to earn partial credit, so most runs train some
steps (non-zero advantages) and the optimizer has state to restore; a step whose 16 rewards are all
equal trains nothing, and runs with three such steps of four happen (reward means near 0.03). Its warm
start is cached where `make run`'s is ($GYRE_CACHE, else ~/.cache/gyre): built once on a machine, as
tests/test_images.py's images are.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from gyre.metrics import read_metrics
from gyre.sched.controller.report import step_rows
from gyre.store.reader import read_shard
from gyre.train.dist_checkpoint import read_whole

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
GROUPS, GROUP_SIZE = 2, 8  # 16 rollouts a step


def tiny_args(out: Path, hydra_dir: Path, *extra: str) -> list[str]:
    return [
        "scheduler=colocate",  # the one-process loop's stop and resume (the default is elastic)
        f"steps={STEPS}",
        f"rl.groups_per_step={GROUPS}",
        f"rl.group_size={GROUP_SIZE}",
        "tasks.families=[write_value]",
        "tasks.tool_delay_s=0.3",  # rollouts last long enough to be caught in flight
        "warm_start.steps=60",
        "warm_start.demos=64",
        "warm_start.batch_size=8",
        "tokenizer.corpus_tasks=60",
        "tokenizer.vocab_size=512",
        "harness.max_turns=3",
        "harness.max_tokens=32",
        f"output_dir={out}",
        f"hydra.run.dir={hydra_dir}",
        *extra,
    ]


def wait_until(what: str, predicate: Callable[[], object], timeout_s: float, alive: Callable[[], bool]) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        if not alive():
            raise AssertionError(f"the job ended before {what}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def in_flight_after_a_step(out: Path, first: int = 0) -> int | None:
    """The step whose rollouts are calling the engine once a step >= `first` has completed; None before.
    Fails the test when no such step comes before the last one."""
    rows = step_rows(read_metrics(out / "metrics.jsonl")) if (out / "metrics.jsonl").exists() else []
    done = [r["step"] for r in rows if r["step"] >= first]
    if not done or done[0] + 1 >= STEPS:
        assert not rows or rows[-1]["step"] + 1 < STEPS, "no step completed before the last one; nothing to stop"
        return None
    nxt = rows[-1]["step"] + 1
    calls = (out / "calls.jsonl").read_text() if (out / "calls.jsonl").exists() else ""
    return nxt if nxt < STEPS and f'"rollout_id": "s{nxt}-' in calls else None


def state(out: Path) -> dict:
    return json.loads((out / "checkpoint" / "state.json").read_text())


def adam_steps(out: Path) -> int:
    """AdamW's own step count in the checkpoint (one per optimizer update since the run began)."""
    stored = read_whole(out / "checkpoint" / "trainer")
    counts = {int(v) for k, v in stored.items() if k.startswith("optimizer.step.")}
    assert len(counts) <= 1, counts
    return counts.pop() if counts else 0


def shard_ids_by_step(out: Path) -> dict[int, list[str]]:
    ids: dict[int, list[str]] = {}
    for path in sorted((out / "shards").glob("*.h5")):
        shard = read_shard(path)
        ids.setdefault(int(shard.attrs["step"]), []).extend(str(r) for r in shard.rollouts["rollout_id"])
    return ids


def assert_each_rollout_once(out: Path, steps: int = STEPS) -> dict:
    """Shards, ledger and metrics of a finished run: every step once, every rollout id once per step,
    every trained rollout trained exactly once. Returns the final checkpoint state."""
    st = state(out)
    assert st["next_step"] == steps and st["weight_version"] == steps
    assert [r["step"] for r in st["ledger"]] == list(range(steps)), "a step missing or trained twice"
    shards = shard_ids_by_step(out)
    assert sorted(shards) == list(range(steps))
    for record in st["ledger"]:
        step = record["step"]
        expected = sorted(f"s{step}-g{g}-r{i}" for g in range(GROUPS) for i in range(GROUP_SIZE))
        duplicated = [rid for rid, n in Counter(shards[step]).items() if n > 1]
        assert not duplicated, f"step {step}: rollouts stored twice: {duplicated}"
        assert sorted(shards[step]) == record["rollouts"]
        assert sorted(record["rollouts"] + record["rejected"]) == expected, f"step {step}: rollouts lost"
        assert set(record["trained"]) <= set(record["rollouts"])
        trainable = sorted(
            r.rollout_id for p in (out / "shards").glob(f"step{step:05d}-*.h5") for r in read_shard(p).trainable()
            if r.meta.advantage
        )  # fmt: skip
        assert record["trained"] == trainable, f"step {step}: trained {record['trained']} != trainable {trainable}"
    trained_steps = sum(1 for r in st["ledger"] if r["trained"])
    assert adam_steps(out) == trained_steps, "the optimizer state was not carried over the restart"
    assert [r["step"] for r in step_rows(read_metrics(out / "metrics.jsonl"))] == list(range(steps))
    assert not (out / "checkpoint.tmp").exists() and not (out / "checkpoint.old").exists()
    return st


def mid_step_with_a_group_done(out: Path, first: int = 2) -> tuple[int, dict[str, tuple[int, int]]] | None:
    """Once the checkpoint holds the steps before k (k >= first), a group of step k has its shard and another group
    of step k is calling the engine without one: (k, {shard name: (inode, mtime ns)} of step k's shards); else None."""
    try:
        k = state(out)["next_step"]
    except (OSError, json.JSONDecodeError):  # no checkpoint yet, or read between the two renames
        return None
    if not first <= k < STEPS:
        return None
    done = {p.name: p.stat() for p in (out / "shards").glob(f"step{k:05d}-group*.h5")}
    calls = (out / "calls.jsonl").read_text() if (out / "calls.jsonl").exists() else ""
    running = [
        g for g in range(GROUPS) if f"step{k:05d}-group{g:04d}.h5" not in done and f'"rollout_id": "s{k}-g{g}-' in calls
    ]
    return (k, {name: (s.st_ino, s.st_mtime_ns) for name, s in done.items()}) if done and running else None


def calls_by_rollout(out: Path) -> Counter:
    """How many calls calls.jsonl records of each rollout (a line being written, cut short, is not counted)."""
    counts: Counter = Counter()
    for line in (out / "calls.jsonl").read_text().splitlines():
        try:
            counts[json.loads(line)["rollout_id"]] += 1
        except json.JSONDecodeError:
            continue
    return counts


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time in clock ticks, state letter) of a process; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[19]), fields[0]


def process_tree(root: int) -> dict[int, int]:
    """{pid: start time} of `root` and every process below it now (engines, MPI ranks, harnesses, checkers)."""
    stats = {int(p.name): s for p in Path("/proc").iterdir() if p.name.isdigit() and (s := _stat(int(p.name)))}
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (ppid, _, _) in stats.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier += children
    return {pid: stats[pid][1] for pid in tree if pid in stats}


def still_running(procs: dict[int, int]) -> list[int]:
    """Which of `procs` run yet: the same process (start time), not a zombie."""
    return [pid for pid, start in procs.items() if (s := _stat(pid)) and s[1] == start and s[2] != "Z"]
