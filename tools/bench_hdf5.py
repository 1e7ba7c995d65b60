"""HDF5 shard benchmark: time to write a 1M-token tree, and streaming micro-batch throughput as a
fraction of a raw sequential read of the same file (both from the page cache, measured side by
side, alternating, medians).

    python -m tools.bench_hdf5 [--tokens 1000000] [--calls 300] [--repeats 5] [--dir /tmp] [--json]

Two files are streamed: the 1M-token tree alone (one oversize micro-batch), and a shard of the
same size made of many small rollouts packed into --budget-token micro-batches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gyre.store.reader import read_shard
from gyre.store.schema import RolloutMeta
from gyre.store.stream import ShardStream, mark_end_of_stream
from gyre.store.writer import write_shard
from gyre.traj.tree import TrajectoryTree
from tools.synthetic_shard import rollout_average_weight, synthetic_tree

META = RolloutMeta("g0", "t0", "bench", "claude_code", "ok", 1.0, 1.0, 0.5)


def tree_of_size(rollout_id: str, n_tokens: int, n_calls: int, seed: int) -> TrajectoryTree:
    """A synthetic Claude-Code-shaped tree with at least n_tokens tokens (one calibration pass)."""
    tree = synthetic_tree(rollout_id, n_tokens, n_calls, np.random.default_rng(seed))
    target = n_tokens
    while tree.n_tokens < n_tokens:
        target = int(target * n_tokens / tree.n_tokens * 1.01)
        tree = synthetic_tree(rollout_id, target, n_calls, np.random.default_rng(seed))
    return tree


def raw_read(path: Path) -> int:
    buf = bytearray(8 << 20)
    n = 0
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            n += k
    return n


def stream_all(directory: Path, budget: int) -> tuple[int, int]:
    batches = tokens = 0
    for batch in ShardStream(directory, budget, poll_s=0.01):
        batches += 1
        tokens += batch.n_tokens
    return batches, tokens


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process): CPU time is what a loaded machine inflates least."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def side_by_side(path: Path, budget: int, repeats: int) -> dict[str, Any]:
    """Alternate raw read, full stream and a read without checksums of one published shard."""
    directory = path.parent
    mark_end_of_stream(directory)
    raw_read(path)  # warm the page cache for both
    batches, tokens = stream_all(directory, budget)
    runs: dict[str, list[tuple[float, float]]] = {"raw_read": [], "stream": [], "read_without_checksums": []}
    for _ in range(repeats):
        runs["raw_read"].append(timed(lambda: raw_read(path)))
        runs["stream"].append(timed(lambda: stream_all(directory, budget)))
        runs["read_without_checksums"].append(timed(lambda: read_shard(path, verify_checksums=False)))
    out: dict[str, Any] = {"file_bytes": path.stat().st_size, "tokens": tokens, "micro_batches": batches}
    out["token_budget"] = budget
    for name, samples in runs.items():
        out[f"{name}_s"] = statistics.median(w for w, _ in samples)
        out[f"{name}_cpu_s"] = statistics.median(c for _, c in samples)
    out["stream_Mtokens_per_s"] = tokens / out["stream_s"] / 1e6
    out["stream_fraction_of_raw"] = out["raw_read_s"] / out["stream_s"]
    out["stream_fraction_of_raw_cpu"] = out["raw_read_cpu_s"] / out["stream_cpu_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", type=int, default=65_536, help="micro-batch token budget for the many-rollout shard")
    ap.add_argument("--small-rollout-tokens", type=int, default=16_384)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    t0 = time.perf_counter()
    big = tree_of_size("big", args.tokens, args.calls, seed=0)
    build_s = time.perf_counter() - t0
    n_small = max(1, big.n_tokens // args.small_rollout_tokens)
    small = [tree_of_size(f"r{i}", args.small_rollout_tokens, 24, seed=i + 1) for i in range(n_small)]

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        big_weight = rollout_average_weight(big)
        write_times = []
        for k in range(args.repeats):
            out = root / f"write{k}" / "big.h5"
            out.parent.mkdir()
            write_times.append(timed(lambda out=out: write_shard(out, [(big, META, big_weight)], run_id="b", step=0)))
        big_path = root / "write0" / "big.h5"
        many_dir = root / "many"
        many_dir.mkdir()
        many_path = many_dir / "many.h5"
        write_shard(many_path, [(t, META, rollout_average_weight(t)) for t in small], run_id="b", step=0)
        one = side_by_side(big_path, budget=big.n_tokens, repeats=args.repeats)
        many = side_by_side(many_path, budget=args.budget, repeats=args.repeats)

    result = {
        "tree": {"tokens": big.n_tokens, "calls": len(big.calls), "paths": int(big.leaves().size), "build_s": build_s},
        "write_1M_tree_s": statistics.median(w for w, _ in write_times),
        "write_1M_tree_cpu_s": statistics.median(c for _, c in write_times),
        "stream_one_big_tree": one,
        "stream_many_rollouts": {"rollouts": n_small, **many},
        "repeats": args.repeats,
        "load_average_1min": os.getloadavg()[0],  # other work on the machine inflates every figure
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"tree: {big.n_tokens:,} tokens, {len(big.calls)} calls, {big.leaves().size} paths (synthetic, built in {build_s:.2f}s)"
    )
    print(
        f"write 1M-token tree (validate, write, fsync, rename): median {result['write_1M_tree_s'] * 1e3:.0f} ms wall, "
        f"{result['write_1M_tree_cpu_s'] * 1e3:.0f} ms cpu ({one['file_bytes'] / 1e6:.1f} MB) over {args.repeats} runs"
    )
    print(f"page cache warm; 1-minute load average {result['load_average_1min']:.1f} on {os.cpu_count()} CPUs")
    print(
        f"{'medians, wall (cpu) ms':<30}{'raw read':>16}{'stream':>16}{'no-crc read':>16}{'fraction':>14}{'batches':>8}"
    )
    for name, r in (("one 1M-token tree", one), (f"{n_small} rollouts, budget {args.budget}", many)):
        cells = [
            f"{r[k + '_s'] * 1e3:.1f} ({r[k + '_cpu_s'] * 1e3:.1f})"
            for k in ("raw_read", "stream", "read_without_checksums")
        ]
        fraction = f"{r['stream_fraction_of_raw']:.2f} ({r['stream_fraction_of_raw_cpu']:.2f})"
        print(f"{name:<30}{cells[0]:>16}{cells[1]:>16}{cells[2]:>16}{fraction:>14}{r['micro_batches']:>8}")


if __name__ == "__main__":
    main()
