"""One forward-backward of one Claude-Code-shaped rollout at a fixed micro-batch budget: split trees vs whole.

Rollouts come from gyre.traj.synthetic at the bench's recorded shape (tools/bench_tree_training.py),
300 calls, every token count divided by --scale per size: 1/100 is ~10K tokens, 1/10 ~100K, 1/1 ~1M
(a 160K-token context, so paths up to ~160K deep). The whole tree is trained (every policy token a
target, weights summing to 1). Each run is a fresh process: MegatronTrainer.forward_backward once to
warm up on a small tree, then --repeats times on the rollout; seconds are medians, memory is the RSS
high-water mark minus the RSS just before the first timed pass.
- split: the tree cut into segments of --budget tokens (gyre/train/split_tree.py);
- whole: the tree in one micro-batch (only up to --whole-max tokens: its memory grows with the tree).
`pairs` is exact attention's (query, key) pairs, sum of (depth + 1), what time should follow.

    python -m tools.bench_split_trees [--scales 100 10 1] [--budget 4096] [--repeats 3] [--whole-max 120000]
        [--context N]     # override the (scaled) context limit, e.g. 1M tokens with shallower paths
        [--fixed-malloc]  # glibc mmap/trim thresholds fixed at 64 KiB: freed temporaries leave the RSS
        [--progress]      # each segment of the backward sweep: a JSON line on stderr (CPU s, peak RSS so far)
        [--vocab 1024 --hidden 64 --layers 2 --heads 2]  # the model (one key/value head, ffn 2 x hidden)

The 1M-token run of docs/architecture.md (hidden 32, 1 layer, 1 head: 18-27 ns per attention pair on this CPU):

    python -m tools.bench_split_trees --scales 100 10 1 --repeats 1 --fixed-malloc --hidden 32 --layers 1 \
        --heads 1 --progress

Memory: a split run holds one segment's activations (logits in row chunks, gyre/train/chunked_logprobs.py),
the cached root path (keys, values and their gradients, 4 x layers x depth x key/value width floats: 83 MB
at the 1M rollout's 162,663-deep path with one layer of width 32) and a few int64 index arrays per tree
token. The path is the floor of exact one-sweep training; it follows the deepest path, not the tree.

A row also has `peak_rss_mb`, the process's absolute RSS high-water mark during the timed passes, and
`wall_s`, the median wall-clock seconds of a pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import numpy as np
import torch

from gyre.config.schema import ModelConfig, TrainConfig
from gyre.train import split_tree as split_tree_module
from gyre.train.megatron_trainer import MegatronTrainer
from gyre.train.tree_pack import pack_forest, split_tree, weighted_token_loss
from tools.bench_tree_training import current_rss_mb, peak_rss_mb, rollout_tree, scaled_shape


def model_cfg(args: argparse.Namespace) -> ModelConfig:
    """A small model of the default architecture, with positions for a 1M-token rollout's deepest path."""
    return ModelConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=args.heads,
        num_query_groups=1, ffn_hidden_size=2 * args.hidden, max_position_embeddings=1 << 18,
    )  # fmt: skip


def reset_peak_rss() -> None:
    """Reset this process's VmHWM to its current RSS (Linux: 5 > /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def report_progress(n_segments: int, before_mb: float) -> None:
    """Each segment of the backward sweep (a forward with gradient) prints CPU seconds and peak RSS (and its
    growth over `before_mb`) to stderr."""
    forward, done, t0 = split_tree_module._forward, [0], time.process_time()

    def counted(*args: object, **kwargs: object) -> object:
        out = forward(*args, **kwargs)
        if args[5]:  # grad: one segment of the sweep
            done[0] += 1
            row = {"segments_done": done[0], "segments": n_segments, "cpu_s": round(time.process_time() - t0, 1)}
            peak = peak_rss_mb()
            row |= {"peak_rss_mb": round(peak), "rss_growth_mb": round(peak - before_mb)}
            print(json.dumps(row), file=sys.stderr, flush=True)
        return out

    split_tree_module._forward = counted


def child(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    trainer = MegatronTrainer(model_cfg(args), TrainConfig(num_threads=1))
    vocab = trainer.model_cfg.vocab_size
    shape = scaled_shape(args.scale, args.calls, 0.02, vocab)
    if args.context:
        shape = dataclasses.replace(shape, context_limit=args.context)
    tree = rollout_tree(shape, args.seed)
    weight = tree.policy.astype(np.float32) / max(int(tree.policy.sum()), 1)
    warm = rollout_tree(scaled_shape(100, 20, 0.0, vocab), 1)
    warm_w = warm.policy.astype(np.float32) / max(int(warm.policy.sum()), 1)
    if args.mode == "split":
        batch = split_tree(tree, args.budget, weight)
        warm_batch = split_tree(warm, max(1, warm.n_tokens // 3), warm_w)
    else:
        batch, warm_batch = pack_forest([tree], [weight]), pack_forest([warm], [warm_w])
    trainer.forward_backward([warm_batch], weighted_token_loss)  # lazy initialisation is not the tree's memory
    trainer.zero_grad()
    gc.collect()
    reset_peak_rss()  # building the call log peaks higher than training may: measure from here
    before = current_rss_mb()
    if args.progress and args.mode == "split":
        report_progress(len(batch.segments), before)
    seconds, wall = [], []
    for _ in range(args.repeats):
        t0, w0 = time.process_time(), time.perf_counter()
        trainer.forward_backward([batch], weighted_token_loss)
        seconds.append(time.process_time() - t0)
        wall.append(time.perf_counter() - w0)
        trainer.zero_grad()
    row = {
        "mode": args.mode,
        "tokens": tree.n_tokens,
        "depth": int(tree.depth.max()) + 1,
        "pairs": int(tree.depth.astype(np.int64).sum()) + tree.n_tokens,
        "segments": len(batch.segments) if args.mode == "split" else 1,
        "seconds": statistics.median(seconds),
        "wall_s": statistics.median(wall),
        "rss_growth_mb": peak_rss_mb() - before,
        "peak_rss_mb": peak_rss_mb(),
    }
    print(json.dumps(row))


def run(args: argparse.Namespace, scale: int, mode: str) -> dict:
    cmd = [sys.executable, "-m", "tools.bench_split_trees", "--child", "--mode", mode, "--scale", str(scale)]
    cmd += ["--budget", str(args.budget), "--repeats", str(args.repeats), "--calls", str(args.calls)]
    cmd += ["--seed", str(args.seed), "--context", str(args.context)]
    cmd += ["--vocab", str(args.vocab), "--hidden", str(args.hidden), "--layers", str(args.layers)]
    cmd += ["--heads", str(args.heads)] + (["--progress"] if args.progress else [])
    env = dict(os.environ)
    if args.fixed_malloc:  # glibc otherwise keeps freed per-block temporaries of varying size resident
        env |= {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=env).stdout  # stderr: progress
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scales", type=int, nargs="+", default=[100, 10, 1])
    parser.add_argument("--budget", type=int, default=TrainConfig().micro_batch_tokens)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--context", type=int, default=0, help="override the scaled context limit (tokens)")
    parser.add_argument(
        "--fixed-malloc", action="store_true", help="fixed glibc mmap/trim thresholds: RSS closer to what is held"
    )
    parser.add_argument("--whole-max", type=int, default=120_000, help="run the whole tree only up to this size")
    parser.add_argument("--progress", action="store_true", help="per-segment progress of split runs on stderr")
    parser.add_argument("--vocab", type=int, default=1024, help="the model's vocabulary (logits are budget x vocab)")
    parser.add_argument("--hidden", type=int, default=64, help="the model's hidden size (ffn: twice that)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2, help="query heads (one key/value head)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="split", help=argparse.SUPPRESS)
    parser.add_argument("--scale", type=int, default=100, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    cfg = model_cfg(args)
    print(
        f"model: hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_attention_heads} heads "
        f"({cfg.num_query_groups} kv), vocab {cfg.vocab_size}; 1 thread; budget {args.budget}; {args.calls} calls; "
        f"CPU seconds, medians of {args.repeats}"
    )
    print(
        f"{'tokens':>9} {'depth':>7} {'pairs':>9} {'segs':>5} {'split s':>8} {'split MB':>9} "
        f"{'whole s':>8} {'whole MB':>9} {'split/whole':>11} {'us/kpair':>8}"
    )
    for scale in args.scales:
        s = run(args, scale, "split")
        w = run(args, scale, "whole") if s["tokens"] <= args.whole_max else None
        ratio = f"{s['seconds'] / w['seconds']:.2f}" if w else "-"
        print(
            f"{s['tokens']:>9,} {s['depth']:>7,} {s['pairs']:>9.2e} {s['segments']:>5} {s['seconds']:>8.2f} "
            f"{s['rss_growth_mb']:>9.0f} {w['seconds'] if w else float('nan'):>8.2f} "
            f"{w['rss_growth_mb'] if w else float('nan'):>9.0f} {ratio:>11} {s['seconds'] / s['pairs'] * 1e9:>8.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
