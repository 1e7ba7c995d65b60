"""Synthetic trajectory trees shaped like Claude Code rollouts, and shards of them.

For benchmarks and for trying the shard tools without a run. The shape follows what the proxy
records from Claude Code (see notes on harness facts): a long system prompt + tool schemas shared
by every main-thread call; each call re-sends the conversation, so a thread is one growing path;
tool outputs dominate the new tokens; compaction (a main_summary call that branches off the thread
minus its last turn) restarts the thread from the system prompt; sub-agents have their own system
prompt, shared among them; a few retries leave dead branches; a title-generation side call.

    python -m tools.synthetic_shard out.h5 --rollouts 8 --tokens 20000 --calls 30
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from gyre.store.schema import RolloutMeta
from gyre.store.writer import write_shard
from gyre.traj.tree import CONTEXT, ROLE_CODE, CallInfo, TrajectoryTree

VOCAB = 32000


@dataclass
class _Segments:
    """A tree as consecutive token runs: each run hangs off an earlier token and is a chain."""

    attach: list[int] = field(default_factory=list)
    length: list[int] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)
    call: list[int] = field(default_factory=list)
    role: list[int] = field(default_factory=list)
    n: int = 0
    end_depth: dict[int, int] = field(default_factory=dict)

    def add(self, attach: int, length: int, role: str, call: int = CONTEXT) -> int:
        """Append a run of `length` tokens under token `attach` (-1: a new root); return its last token."""
        length = max(1, int(length))
        self.attach.append(attach)
        self.length.append(length)
        self.policy.append(call != CONTEXT)
        self.call.append(call)
        self.role.append(ROLE_CODE[role])
        start_depth = 0 if attach < 0 else self.end_depth[attach] + 1
        self.n += length
        self.end_depth[self.n - 1] = start_depth + length - 1
        return self.n - 1


def synthetic_tree(rollout_id: str, n_tokens: int, n_calls: int, rng: np.random.Generator) -> TrajectoryTree:
    """About `n_tokens` tree tokens over `n_calls` calls (exact counts vary with the random shape)."""
    s = _Segments()
    calls: list[CallInfo] = []
    per_call = max(8.0, (n_tokens - 0.02 * n_tokens) / n_calls)  # new tokens per call after the system prompts
    system_len = int(min(12_000, 0.01 * n_tokens + 64))
    compact_limit = max(4 * per_call, min(150_000, 0.2 * n_tokens))
    t = 1.7e9

    def lognormal(mean: float) -> int:
        return max(1, int(rng.lognormal(np.log(mean) - 0.125, 0.5)))

    def call(attach: int, context: int, output: int, role: str, finish: str = "stop", excluded: str = "") -> int:
        """A call's new context then its output; an excluded call's output is stored as context."""
        nonlocal t
        if context > 0:
            attach = s.add(attach, context, role)
        cid = len(calls)
        leaf = s.add(attach, output, role, call=CONTEXT if excluded else cid)
        n_out = s.length[-1]
        info = CallInfo(cid, role, leaf, s.end_depth[leaf] + 1 - n_out, n_out, f"v{cid // 100}", finish, t, t + 2.0)
        calls.append(replace(info, trained=role != "side" and not excluded, excluded=excluded))
        t += 3.0
        return leaf

    main_root = s.add(-1, system_len, "main")
    call(s.add(-1, 300, "side"), 40, 12, "side")  # title generation
    sub_root = -1
    leaf, before_last, context_len = main_root, main_root, system_len
    remaining = n_calls - 1
    while remaining > 0:
        if context_len > compact_limit and remaining >= 2:  # compaction: summarise, restart the thread
            call(before_last, 200, lognormal(0.3 * per_call), "main_summary")
            leaf = before_last = call(main_root, lognormal(0.3 * per_call), lognormal(0.1 * per_call), "main")
            context_len, remaining = s.end_depth[leaf] + 1, remaining - 2
        elif rng.random() < 0.08 and remaining >= 3:  # a sub-agent of a few calls
            if sub_root < 0:
                sub_root = s.add(-1, system_len // 2, "subagent")
            sub_leaf = sub_root
            for _ in range(min(remaining - 1, int(rng.integers(2, 6)))):
                sub_leaf = call(sub_leaf, lognormal(0.9 * per_call), lognormal(0.1 * per_call), "subagent")
                remaining -= 1
            before_last, leaf = leaf, call(leaf, lognormal(0.1 * per_call), lognormal(0.1 * per_call), "main")
            context_len, remaining = s.end_depth[leaf] + 1, remaining - 1
        else:
            context = lognormal(0.9 * per_call)
            if rng.random() < 0.03 and remaining >= 2:  # a dropped reply: a dead branch, then the retry
                call(leaf, context, lognormal(0.1 * per_call), "main", finish="abort")
                remaining -= 1
            elif rng.random() < 0.02 and remaining >= 2:  # a truncated record: kept as context, not trained
                call(leaf, context, lognormal(0.1 * per_call), "main", excluded="truncated record (synthetic)")
                remaining -= 1
            before_last, leaf = leaf, call(leaf, context, lognormal(0.1 * per_call), "main")
            context_len, remaining = s.end_depth[leaf] + 1, remaining - 1
    return _materialise(rollout_id, s, calls, rng)


def _materialise(rollout_id: str, s: _Segments, calls: list[CallInfo], rng: np.random.Generator) -> TrajectoryTree:
    length = np.asarray(s.length, dtype=np.int64)
    start = np.concatenate([[0], np.cumsum(length)[:-1]])
    seg_of = np.repeat(np.arange(len(length)), length)
    offset = np.arange(s.n) - start[seg_of]
    parent = np.where(offset == 0, np.asarray(s.attach)[seg_of], np.arange(s.n) - 1)
    attach = np.asarray(s.attach)
    start_depth = np.array([0 if a < 0 else s.end_depth[int(a)] + 1 for a in attach], dtype=np.int64)
    policy = np.asarray(s.policy)[seg_of]
    return TrajectoryTree(
        rollout_id=rollout_id,
        tokens=rng.integers(0, VOCAB, s.n, dtype=np.int32),
        parent=parent.astype(np.int32),
        depth=(start_depth[seg_of] + offset).astype(np.int32),
        policy=policy,
        logprob=np.where(policy, -rng.exponential(0.5, s.n), 0.0).astype(np.float32),
        call_id=np.asarray(s.call, dtype=np.int64)[seg_of],
        role=np.asarray(s.role, dtype=np.uint8)[seg_of],
        calls=calls,
    )


def rollout_average_weight(tree: TrajectoryTree) -> np.ndarray:
    """Loss weight 1/n on each of the n policy tokens of trained calls (every path kept: no bounding)."""
    trained_calls = np.array([c.call_id for c in tree.calls if c.trained], dtype=np.int64)
    mask = tree.policy & np.isin(tree.call_id, trained_calls)
    return (mask / max(1, int(mask.sum()))).astype(np.float32)


def write_synthetic_shard(
    path: str | Path, n_rollouts: int, n_tokens: int, n_calls: int, seed: int = 0, step: int = 0
) -> Path:
    """A shard of one GSPO group: rewards in [0, 1], every fifth rollout timed out, the last one's
    evaluation failed (excluded), advantages normalised over the graded rollouts."""
    rng = np.random.default_rng(seed)
    trees = [synthetic_tree(f"s{step}-r{i}", n_tokens, n_calls, rng) for i in range(n_rollouts)]
    failed = {n_rollouts - 1} if n_rollouts > 1 else set()
    scores = np.round(rng.random(n_rollouts), 2)
    graded = [i for i in range(n_rollouts) if i not in failed]
    mean, std = scores[graded].mean(), scores[graded].std() + 1e-6
    rollouts = []
    for i, tree in enumerate(trees):
        status = "failed" if i in failed else ("timeout" if i % 5 == 4 else "ok")
        ok = status != "failed"
        meta = RolloutMeta(
            group_id=f"s{step}-g0",
            task_id=f"task-{i % 3}",
            task_family=("write_value", "echo_files")[i % 2],
            harness="claude_code",
            grade_status=status,
            score=float(scores[i]) if ok else None,
            reward=float(scores[i]) if ok else None,
            advantage=float((scores[i] - mean) / std) if ok else None,
            exclusion_reason="" if ok else "checker exited with code 1: workspace missing",
        )
        rollouts.append((tree, meta, rollout_average_weight(tree)))
    return write_shard(path, rollouts, run_id="synthetic", step=step, producer={"tool": "tools.synthetic_shard"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="shard path (*.h5)")
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=20_000, help="tree tokens per rollout (approximate)")
    ap.add_argument("--calls", type=int, default=30, help="calls per rollout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step", type=int, default=0)
    args = ap.parse_args()
    print(write_synthetic_shard(args.out, args.rollouts, args.tokens, args.calls, args.seed, args.step))


if __name__ == "__main__":
    main()
