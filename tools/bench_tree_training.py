"""Tree-packed training vs expanded sequences on Claude-Code-shaped rollouts: tokens, forward-backward time, memory.

Rollouts come from gyre.traj.synthetic (main thread re-sending its whole conversation each call,
sub-agents, compactions, dropped retries) with every token count of its default shape divided by
--scale (call count and probabilities as given), built into trees by gyre.traj.build and bounded
to K root-to-leaf paths by gyre.traj.sampling (K=5, and unbounded). For each, side by side:
- tree:  one tree-packed micro-batch, every token once (gyre.train.tree_pack);
- paths: every kept root-to-leaf path as its own plain sequence (same trainer, same attention
         kernel: a path is a one-chain tree); shared target tokens counted once in the loss;
- calls: every kept call's own context + output as a sequence (tokens only; --time-calls times it).
Forward-backward is MegatronTrainer.forward_backward with per-token weights, 1 torch thread, the
default ModelConfig; times are CPU seconds (medians over --repeats, the variants interleaved).
Then peak memory: resident-set growth of one forward-backward in a fresh process, vs tree size.

    python -m tools.bench_tree_training [--scale 40] [--calls 100] [--p-retry 0.02 0.1] [--repeats 3]
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

import numpy as np
import torch

from gyre.config.schema import ModelConfig, TrainConfig
from gyre.train.megatron_trainer import MegatronTrainer
from gyre.train.tree_pack import TreeMicroBatch, pack_trees, weighted_token_loss
from gyre.traj.build import build_tree
from gyre.traj.sampling import SampledTree, sample_tree, subtree
from gyre.traj.synthetic import RolloutShape, claude_code_like_rollout
from gyre.traj.tree import TrajectoryTree

UNBOUNDED = 1 << 30


def scaled_shape(scale: int, calls: int, p_retry: float, vocab: int) -> RolloutShape:
    d = RolloutShape()
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


@dataclass
class Variant:
    name: str
    batches: list[TreeMicroBatch]

    @property
    def tokens(self) -> int:
        return sum(mb.n_tokens for mb in self.batches)


def variants(tree: TrajectoryTree, k: int, budget: int) -> tuple[SampledTree, list[Variant], int]:
    sampled = sample_tree(tree, k=k)
    packed = pack_trees([sampled.tree], max(budget, sampled.tree.n_tokens), [sampled.loss_weight])
    paths, path_w = chains(sampled, sampled.path_leaves.tolist())
    longest = max(p.n_tokens for p in paths)
    path_batches = pack_trees(paths, max(budget, longest), path_w)
    call_tokens = sum(int(sampled.tree.depth[leaf]) + 1 for leaf in trained_call_leaves(sampled))
    return sampled, [Variant("tree", packed), Variant("paths", path_batches)], call_tokens


def fwd_bwd_seconds(trainer: MegatronTrainer, batches: list[TreeMicroBatch]) -> float:
    """CPU seconds of one forward-backward: with one torch thread on a shared machine, CPU time is what the
    work costs; wall time also counts other processes' turns on the cores."""
    trainer.zero_grad()
    t0 = time.process_time()
    trainer.forward_backward(batches, weighted_token_loss)
    return time.process_time() - t0


def compare(args: argparse.Namespace, trainer: MegatronTrainer) -> None:
    print(
        f"{'p_retry':>7} {'K':>5} {'paths':>5} {'tree tok':>9} {'path tok':>9} {'call tok':>9} "
        f"{'tok x':>6} {'call x':>6} {'tree s':>7} {'paths s':>8} {'time x':>6}"
        + ("  calls s" if args.time_calls else "")
    )
    for p_retry in args.p_retry:
        tree = rollout_tree(scaled_shape(args.scale, args.calls, p_retry, trainer.model_cfg.vocab_size), args.seed)
        per_k: dict[int, tuple[int, float]] = {}
        for k in (5, UNBOUNDED):
            sampled, vs, call_tokens = variants(tree, k, args.budget)
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
                f"{call_tokens:>9,} {path_tok / tree_tok:>6.2f} {call_tokens / tree_tok:>6.1f} {med['tree']:>7.2f} "
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
    tree = rollout_tree(scaled_shape(args.scale, args.memory_child, args.p_retry[0], trainer.model_cfg.vocab_size), 0)
    sampled = sample_tree(tree, k=UNBOUNDED)
    batches = pack_trees([sampled.tree], sampled.tree.n_tokens, [sampled.loss_weight])
    warm = sample_tree(rollout_tree(scaled_shape(args.scale, 3, 0.0, trainer.model_cfg.vocab_size), 1), k=UNBOUNDED)
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
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--p-retry", type=float, nargs="+", default=[0.02, 0.1])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=int, default=16384, help="micro-batch token budget")
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
        "tok x = path tokens / tree tokens, call x = call tokens / tree tokens, time x = paths s / tree s"
    )
    compare(args, make_trainer())
    if args.memory_calls:
        memory_vs_size(args)


if __name__ == "__main__":
    main()
