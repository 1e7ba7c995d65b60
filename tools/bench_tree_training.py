"""Tree-packed training vs expanded sequences on Claude-Code-shaped rollouts: tokens, forward-backward time, memory.

Rollouts come from gyre.proxy.synthetic (main thread re-sending its whole conversation each call,
sub-agents, compactions, dropped retries). Their shape is RolloutShape's default (300 calls, ~1M
tokens, a 20K-token system prompt and tools as in Claude Code's ~78 KB requests, 160K context)
with the sub-agent's system prompt and tools sized by the ratio recorded from Claude Code
(tests/data/claude_code_calls.jsonl, tools/record_claude_code.py). Trees are built by
gyre.traj.build and bounded to K root-to-leaf paths by gyre.traj.sampling (K=5, and unbounded).
Counted side by side:
- tree:  one tree-packed micro-batch, every token once (gyre.train.tree_pack);
- paths: every kept root-to-leaf path as its own plain sequence (same trainer, same attention
         kernel: a path is a one-chain tree); shared target tokens counted once in the loss;
- calls: every kept call's own context + output as a sequence (tokens only; --time-calls times it).

1. The recorded session: what a sub-agent, a summary and a compacted thread share with the thread
   they come from, and its tree / path / call tokens.
2. Full-size rollouts, tokens only (the ratios depend on the shape alone), medians over --seeds.
3. Forward-backward at 1/--scale of every token count, same call count and probabilities (so as many
   compactions and sub-agents as full size): MegatronTrainer.forward_backward with per-token weights,
   1 torch thread, the default ModelConfig; CPU seconds, medians over --repeats, variants interleaved.
4. Peak memory: resident-set growth of one forward-backward in a fresh process, vs tree size.

    python -m tools.bench_tree_training [--tokens-only] [--scale 40] [--calls 300] [--p-retry 0 0.02 0.1]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from gyre.config.schema import ModelConfig, TrainConfig
from gyre.proxy.call_log import CallRecord, read_call_log
from gyre.proxy.synthetic import RolloutShape, claude_code_like_rollout
from gyre.train.megatron_trainer import MegatronTrainer
from gyre.train.tree_pack import TreeMicroBatch, pack_trees, weighted_token_loss
from gyre.traj.build import build_tree
from gyre.traj.sampling import SampledTree, sample_tree, subtree
from gyre.traj.tree import TrajectoryTree

UNBOUNDED = 1 << 30
RECORDING = Path(__file__).resolve().parents[1] / "tests" / "data" / "claude_code_calls.jsonl"


def bench_shape() -> RolloutShape:
    """RolloutShape's default with the sub-agent's system prompt sized as recorded (see recorded_shape)."""
    return recorded_shape(read_call_log(RECORDING))


def scaled_shape(scale: int, calls: int, p_retry: float, vocab: int, base: RolloutShape | None = None) -> RolloutShape:
    """`base` (default: bench_shape()) with every token count divided by `scale`."""
    d = base or bench_shape()
    return replace(
        d,
        n_calls=calls,
        vocab=vocab,
        system_tokens=d.system_tokens // scale,
        subagent_system_tokens=d.subagent_system_tokens // scale,
        output_tokens=(max(1, d.output_tokens[0] // scale), d.output_tokens[1] // scale),
        tool_result_tokens=(max(1, d.tool_result_tokens[0] // scale), d.tool_result_tokens[1] // scale),
        context_limit=d.context_limit // scale,
        p_retry=p_retry,
    )


def rollout_tree(shape: RolloutShape, seed: int) -> TrajectoryTree:
    return build_tree("r0", claude_code_like_rollout(shape, seed=seed, rollout_id="r0"))


def chains(sampled: SampledTree, ends: list[int]) -> tuple[list[TrajectoryTree], list[np.ndarray]]:
    """The root paths ending at `ends` as one-chain trees, each target weighted on its first path only."""
    tree, claimed = sampled.tree, np.zeros(sampled.tree.n_tokens, bool)
    out, weights = [], []
    for k, end in enumerate(ends):
        nodes = tree.path_to(int(end))
        w = np.where(claimed[nodes], 0.0, sampled.loss_weight[nodes]).astype(np.float32)
        claimed[nodes] = True
        path = subtree(tree, nodes)
        path.rollout_id = f"path{k}"
        out.append(path)
        weights.append(w)
    return out, weights


def trained_call_leaves(sampled: SampledTree) -> list[int]:
    return [c.leaf for c in sampled.tree.calls if c.trained and not c.excluded and c.role != "side"]


def call_tokens(sampled: SampledTree) -> int:
    """Tokens if every trained call's own context + output were a sequence of its own."""
    return sum(int(sampled.tree.depth[leaf]) + 1 for leaf in trained_call_leaves(sampled))


@dataclass
class Variant:
    name: str
    batches: list[TreeMicroBatch]

    @property
    def tokens(self) -> int:
        return sum(mb.n_tokens for mb in self.batches)

    @property
    def attention_pairs(self) -> int:
        """(query, key) pairs the attention kernel scores: about sum over tokens of depth + 1, the cost
        that dominates long contexts (deterministic, unlike seconds on a shared machine)."""
        return sum(
            (qb - qa) * sum(b - a for a, b in keys) for mb in self.batches for qa, qb, keys in mb.attention.blocks
        )


def variants(tree: TrajectoryTree, k: int, budget: int) -> tuple[SampledTree, list[Variant], int]:
    sampled = sample_tree(tree, k=k)
    packed = pack_trees([sampled.tree], max(budget, sampled.tree.n_tokens), [sampled.loss_weight])
    paths, path_w = chains(sampled, sampled.path_leaves.tolist())
    longest = max(p.n_tokens for p in paths)
    path_batches = pack_trees(paths, max(budget, longest), path_w)
    return sampled, [Variant("tree", packed), Variant("paths", path_batches)], call_tokens(sampled)


class Counts(NamedTuple):
    """Of a tree bounded to K paths: paths kept; tokens tree-packed, as paths, as calls; and exact
    attention's (query, key) pairs, sum of (depth + 1), tree-packed and as paths."""

    paths: int
    tree_tokens: int
    path_tokens: int
    call_tokens: int
    tree_attention: int
    path_attention: int


def token_counts(tree: TrajectoryTree, k: int) -> Counts:
    """Counts of `tree` bounded to k paths (no training)."""
    sampled = sample_tree(tree, k=k)
    t = sampled.tree
    path_len = np.array([int(t.depth[leaf]) + 1 for leaf in sampled.path_leaves], dtype=np.int64)
    tree_attention = int(t.depth.astype(np.int64).sum()) + t.n_tokens
    path_attention = int((path_len * (path_len + 1) // 2).sum())
    return Counts(
        sampled.n_paths, t.n_tokens, int(path_len.sum()), call_tokens(sampled), tree_attention, path_attention
    )


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def thread_stats(calls: list[CallRecord]) -> dict[str, dict[str, int]]:
    """Per thread role ("main", "subagent") of a recorded session, token counts read off its calls:
    `first` (the thread's first prompt), `with_main` (what that prompt shares with main's first), and
    once compacted `summarized` / `summary_shares` / `summary_adds` (the thread its summary call
    covers, the part of it the summary's prompt shares, what the summary's prompt adds) and `system`
    (what the compacted thread's first prompt shares with the thread's first: system prompt and tools)."""
    calls = sorted(calls, key=lambda c: c.call_id)
    first = {role: next((c for c in calls if c.role == role), None) for role in ("main", "subagent")}
    stats: dict[str, dict[str, int]] = {}
    for role, head in first.items():
        if head is None:
            continue
        st = stats[role] = {"first": len(head.input_ids)}
        if first["main"] is not None:
            st["with_main"] = common_prefix(head.input_ids, first["main"].input_ids)
        summary = next((c for c in calls if c.role == f"{role}_summary"), None)
        if summary is None:
            continue
        before = [c for c in calls if c.role == role and c.call_id < summary.call_id][-1]
        thread = before.input_ids + before.output_ids
        shared = common_prefix(summary.input_ids, thread)
        st.update(summarized=len(thread), summary_shares=shared, summary_adds=len(summary.input_ids) - shared)
        after = next((c for c in calls if c.role == role and c.call_id > summary.call_id), None)
        if after is not None:
            st["system"] = common_prefix(after.input_ids, head.input_ids)
    return stats


def recorded_structure(calls: list[CallRecord]) -> list[str]:
    """What the threads of a recorded session share, one fact a line."""
    lines = [", ".join(f"{sum(c.role == r for c in calls)} {r}" for r in dict.fromkeys(c.role for c in calls))]
    for role, st in thread_stats(calls).items():
        if role != "main" and "with_main" in st:
            lines.append(f"{role}: first prompt {st['first']} tokens, shares {st['with_main']} with main's")
        if "summarized" in st:
            lines.append(
                f"{role} summary: shares {st['summary_shares']} of the {st['summarized']} tokens of the thread it "
                f"summarizes, adds {st['summary_adds']}"
            )
        if "system" in st:
            lines.append(
                f"{role} after compaction: shares {st['system']} tokens (system prompt and tools) with the "
                f"thread's first prompt of {st['first']}"
            )
    return lines


def recorded_shape(calls: list[CallRecord], base: RolloutShape | None = None) -> RolloutShape:
    """`base` (default: RolloutShape()) with the sub-agent's system prompt and tools sized as recorded,
    relative to main's (both threads compacted in the recording); base itself when it cannot tell."""
    base = base or RolloutShape()
    st = thread_stats(calls)
    main, sub = st.get("main", {}), st.get("subagent", {})
    if not main.get("system") or not sub.get("system"):
        return base
    return replace(base, subagent_system_tokens=round(base.system_tokens * sub["system"] / main["system"]))


def token_row(tree: TrajectoryTree) -> list[str]:
    rows = []
    for k in (5, UNBOUNDED):
        c = token_counts(tree, k)
        rows.append(
            f"K={'all' if k == UNBOUNDED else k}: {c.paths} paths, tokens tree {c.tree_tokens:,} paths "
            f"{c.path_tokens:,} ({c.path_tokens / c.tree_tokens:.2f}x) calls {c.call_tokens:,} "
            f"({c.call_tokens / c.tree_tokens:.1f}x), attention pairs {c.path_attention / c.tree_attention:.2f}x"
        )
    return rows


def recorded_session(calls: list[CallRecord], shape: RolloutShape) -> None:
    print(f"\nrecorded Claude Code session ({RECORDING.name}):")
    for line in recorded_structure(calls):
        print(f"  {line}")
    for row in token_row(build_tree(calls[0].rollout_id, calls)):
        print(f"  {row}")
    print(
        f"  synthetic shape: system prompt and tools {shape.system_tokens:,} tokens (Claude Code's ~78 KB request "
        f"body), sub-agent's {shape.subagent_system_tokens:,} (the recorded ratio)"
    )


def full_size_tokens(shape: RolloutShape, p_retries: list[float], seeds: int) -> None:
    """Median token counts of full-size rollouts; paths/tree is set by the shape alone."""
    print(f"\nfull-size synthetic rollouts ({shape.n_calls} calls), medians over {seeds} seeds:")
    print(
        f"{'p_retry':>7} {'K':>5} {'paths':>5} {'tree tok':>10} {'path tok':>10} {'call tok':>11} {'tok x':>6} "
        f"{'call x':>6} {'attn x':>6}"
    )
    for p_retry in p_retries:
        trees = [rollout_tree(replace(shape, p_retry=p_retry), seed) for seed in range(seeds)]
        for k in (5, UNBOUNDED):
            rows = np.array([token_counts(t, k) for t in trees], dtype=float)
            n_paths, tree_tok, path_tok, call_tok = np.median(rows[:, :4], axis=0)
            tok_x, call_x = np.median(rows[:, 2] / rows[:, 1]), np.median(rows[:, 3] / rows[:, 1])
            attn_x = np.median(rows[:, 5] / rows[:, 4])
            print(
                f"{p_retry:>7} {'all' if k == UNBOUNDED else k:>5} {n_paths:>5.0f} {tree_tok:>10,.0f} {path_tok:>10,.0f} "
                f"{call_tok:>11,.0f} {tok_x:>6.2f} {call_x:>6.1f} {attn_x:>6.2f}",
                flush=True,
            )


def fwd_bwd_seconds(trainer: MegatronTrainer, batches: list[TreeMicroBatch]) -> float:
    """CPU seconds of one forward-backward: with one torch thread on a shared machine, CPU time is what the
    work costs; wall time also counts other processes' turns on the cores."""
    trainer.zero_grad()
    t0 = time.process_time()
    trainer.forward_backward(batches, weighted_token_loss)
    return time.process_time() - t0


def compare(args: argparse.Namespace, shape: RolloutShape, trainer: MegatronTrainer) -> None:
    print(
        f"{'p_retry':>7} {'K':>5} {'paths':>5} {'tree tok':>9} {'path tok':>9} {'call tok':>9} "
        f"{'tok x':>6} {'call x':>6} {'attn x':>6} {'tree s':>7} {'paths s':>8} {'time x':>6}"
        + ("  calls s" if args.time_calls else "")
    )
    for p_retry in args.p_retry:
        tree = rollout_tree(
            scaled_shape(args.scale, args.calls, p_retry, trainer.model_cfg.vocab_size, shape), args.seed
        )
        per_k: dict[int, tuple[int, float]] = {}
        for k in (5, UNBOUNDED):
            sampled, vs, n_call_tokens = variants(tree, k, args.budget)
            if args.time_calls:
                calls, w = chains(sampled, trained_call_leaves(sampled))
                vs.append(Variant("calls", pack_trees(calls, max(args.budget, max(c.n_tokens for c in calls)), w)))
            times: dict[str, list[float]] = {v.name: [] for v in vs}
            for v in vs:  # warm-up, untimed
                fwd_bwd_seconds(trainer, v.batches)
            for _ in range(args.repeats):
                for v in vs:
                    times[v.name].append(fwd_bwd_seconds(trainer, v.batches))
            med = {name: statistics.median(t) for name, t in times.items()}
            tree_tok, path_tok = vs[0].tokens, vs[1].tokens
            per_k[k] = (tree_tok, med["tree"])
            print(
                f"{p_retry:>7} {'all' if k == UNBOUNDED else k:>5} {sampled.n_paths:>5} {tree_tok:>9,} {path_tok:>9,} "
                f"{n_call_tokens:>9,} {path_tok / tree_tok:>6.2f} {n_call_tokens / tree_tok:>6.1f} "
                f"{vs[1].attention_pairs / vs[0].attention_pairs:>6.2f} {med['tree']:>7.2f} "
                f"{med['paths']:>8.2f} {med['paths'] / med['tree']:>6.2f}"
                + (f" {med['calls']:>8.2f} ({med['calls'] / med['tree']:.1f}x)" if args.time_calls else ""),
                flush=True,
            )
        (tok5, t5), (tok_all, t_all) = per_k[5], per_k[UNBOUNDED]
        if tok5 == tok_all:
            print(f"{'':>7} K=5 keeps every path of this rollout (same tree; the time difference is noise)")
        else:
            cut = f"{1 - tok5 / tok_all:.0%} fewer tokens, {1 - t5 / t_all:.0%} less time"
            print(f"{'':>7} K=5 vs unbounded, tree-packed: {cut}")


def peak_rss_mb() -> float:
    """This process image's RSS high-water mark (VmHWM; ru_maxrss would carry over the forking parent's)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def memory_child(args: argparse.Namespace) -> None:
    """One forward-backward of one tree in this (fresh) process; prints its size and the RSS high-water growth
    over the resident set just before it (model, optimizer and packed tree already in memory)."""
    trainer = make_trainer()
    shape, vocab = bench_shape(), trainer.model_cfg.vocab_size
    tree = rollout_tree(scaled_shape(args.scale, args.memory_child, args.p_retry[0], vocab, shape), 0)
    sampled = sample_tree(tree, k=UNBOUNDED)
    batches = pack_trees([sampled.tree], sampled.tree.n_tokens, [sampled.loss_weight])
    warm = sample_tree(rollout_tree(scaled_shape(args.scale, 3, 0.0, vocab, shape), 1), k=UNBOUNDED)
    trainer.forward_backward(pack_trees([warm.tree], warm.tree.n_tokens, [warm.loss_weight]), weighted_token_loss)
    trainer.zero_grad()  # a small warm-up pass first: lazy initialisation is not the tree's memory
    before = current_rss_mb()
    trainer.forward_backward(batches, weighted_token_loss)
    mb = batches[0]
    print(
        json.dumps(
            {
                "tokens": mb.n_tokens,
                "max_depth": int(mb.positions.max()),
                "blocks": len(mb.attention.blocks),
                "max_block_keys": mb.attention.max_keys(),
                "rss_growth_mb": peak_rss_mb() - before,
                "rss_peak_mb": peak_rss_mb(),
            }
        )
    )


def memory_vs_size(args: argparse.Namespace) -> None:
    print("\npeak memory of one forward-backward of the unbounded tree (fresh process each: RSS high-water mark minus")
    print("the RSS just before it), against what one layer's dense N x N fp32 scores alone would take")
    print(
        f"{'calls':>6} {'tokens':>8} {'depth':>6} {'keys/blk':>8} {'RSS +MB':>8} {'MB/1k tok':>9} {'dense NxN MB':>12}"
    )
    heads = make_trainer_cfg().num_attention_heads
    for calls in args.memory_calls:
        cmd = [sys.executable, "-m", "tools.bench_tree_training", "--memory-child", str(calls)]
        cmd += ["--scale", str(args.scale), "--p-retry", str(args.p_retry[0])]
        res = json.loads(
            subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        )
        n = res["tokens"]
        dense_mb = n * n * heads * 4 / 2**20  # one layer's fp32 scores for a dense [N, N] mask, before softmax copies
        print(
            f"{calls:>6} {n:>8,} {res['max_depth']:>6} {res['max_block_keys']:>8} {res['rss_growth_mb']:>8.0f} "
            f"{res['rss_growth_mb'] / n * 1000:>9.1f} {dense_mb:>12,.0f}",
            flush=True,
        )


def make_trainer_cfg() -> ModelConfig:
    return replace(ModelConfig(), max_position_embeddings=1 << 16)


def make_trainer() -> MegatronTrainer:
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    return MegatronTrainer(make_trainer_cfg(), TrainConfig(num_threads=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=int, default=40, help="divide the default shape's token counts by this")
    parser.add_argument(
        "--calls", type=int, default=300, help="calls a rollout (300: as many compactions as full size)"
    )
    parser.add_argument("--p-retry", type=float, nargs="+", default=[0.0, 0.02, 0.1])
    parser.add_argument("--seeds", type=int, default=5, help="full-size rollouts per p_retry in the token table")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=int, default=16384, help="micro-batch token budget")
    parser.add_argument("--tokens-only", action="store_true", help="only the token counts (no training, seconds)")
    parser.add_argument("--time-calls", action="store_true", help="also time per-call sequences (slow)")
    parser.add_argument("--memory-calls", type=int, nargs="*", default=[50, 100, 200, 400])
    parser.add_argument("--memory-child", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.memory_child:
        memory_child(args)
        return
    cfg = make_trainer_cfg()
    print(
        f"model: hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_attention_heads} heads "
        f"({cfg.num_query_groups} kv), vocab {cfg.vocab_size}; 1 thread; scale 1/{args.scale}, {args.calls} calls, "
        f"seed {args.seed}; medians of {args.repeats}\n"
        "tok x = path tokens / tree tokens, call x = call tokens / tree tokens, attn x = (query, key) pairs scored\n"
        "by attention, paths / tree; time x = paths s / tree s"
    )
    calls = read_call_log(RECORDING)
    shape = recorded_shape(calls)
    recorded_session(calls, shape)
    full_size_tokens(shape, args.p_retry, args.seeds)
    if args.tokens_only:
        return
    print(f"\nforward-backward, scale 1/{args.scale}, {args.calls} calls:")
    compare(args, shape, make_trainer())
    if args.memory_calls:
        memory_vs_size(args)


if __name__ == "__main__":
    main()
