"""Time building trajectory trees from Claude-Code-shaped call logs (and bounded sampling on them).

Rollouts of 75, 150 and 300 calls with the default shape (20K-token system prompt and tools,
tool results up to 6K tokens, compaction past 160K, sub-agents, retries, side calls): the 300-call
one is about 1M tree tokens from about 22M recorded input tokens. Figures are medians of --repeats.

    python -m tools.bench_tree_build [--calls 75 150 300] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

from gyre.proxy.synthetic import RolloutShape, claude_code_like_rollout
from gyre.traj.build import build_tree
from gyre.traj.sampling import sample_tree


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, nargs="+", default=[75, 150, 300])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    print(f"{'calls':>6} {'tree tok':>10} {'record tok':>11} {'dedup':>6} {'build s':>8} {'Mtok/s':>7} {'sample s':>9}")
    for n_calls in args.calls:
        records = claude_code_like_rollout(replace(RolloutShape(), n_calls=n_calls), seed=0)
        recorded = sum(len(r.input_ids) + len(r.output_ids) for r in records)
        tree = build_tree("r0", records)
        tree.validate()
        build_s = median_seconds(lambda records=records: build_tree("r0", records), args.repeats)
        sample_s = median_seconds(lambda tree=tree: sample_tree(tree), args.repeats)
        print(
            f"{n_calls:>6} {tree.n_tokens:>10,} {recorded:>11,} {recorded / tree.n_tokens:>6.1f} "
            f"{build_s:>8.2f} {recorded / build_s / 1e6:>7.1f} {sample_s:>9.3f}"
        )


if __name__ == "__main__":
    main()
