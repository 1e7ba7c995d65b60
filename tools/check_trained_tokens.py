"""Check a finished run's training data against its call log: what is trained is what the policy sampled.

For every stored, non-excluded rollout of `<run>/shards/*.h5`: the tokens with loss weight are exactly the
tree's policy tokens, and those are exactly the output tokens of the rollout's trained calls in
`<run>/calls.jsonl` (each call's root-to-leaf path is its input ids then its output ids, and each output
token carries the engine's behaviour logprob). Then it prints each step's success, `ratio_mean` and
`clip_frac` from `metrics.jsonl`: on-policy, the trainer's logprobs of the sampled tokens equal the
engine's, so ratio_mean is 1 (within ~1e-3) and nothing is clipped.

    python -m tools.check_trained_tokens outputs/<run>
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from gyre.metrics import read_metrics
from gyre.sched.controller.report import step_rows
from gyre.store.reader import read_shard


def check_run(run: Path) -> tuple[int, int, list[str]]:
    """(rollouts checked, call output tokens checked, problems)."""
    calls: dict[str, dict[int, dict]] = defaultdict(dict)
    for line in (run / "calls.jsonl").read_text().splitlines():
        c = json.loads(line)
        calls[c["rollout_id"]][c["call_id"]] = c
    problems: list[str] = []
    n_rollouts = n_tokens = 0
    for shard in sorted((run / "shards").glob("*.h5")):
        for r in read_shard(shard):
            if r.meta.exclusion_reason:
                continue
            n_rollouts += 1
            tree, rid = r.tree, r.rollout_id
            policy = set(np.flatnonzero(tree.policy).tolist())
            if set(np.flatnonzero(r.loss_weight > 0).tolist()) != policy:
                problems.append(f"{rid}: the loss-weighted tokens are not the policy tokens")
            outputs: set[int] = set()
            for info in tree.calls:
                if not info.trained:
                    continue
                call = calls[rid][info.call_id]
                path = tree.path_to(info.leaf)
                n_in, want = len(call["input_ids"]), call["input_ids"] + call["output_ids"]
                if tree.tokens[path].tolist()[: len(want)] != want:
                    problems.append(f"{rid} call {info.call_id}: its path is not its input + output ids")
                    continue
                out = path[n_in : len(want)]
                logprobs = np.asarray(call["output_logprobs"], dtype=np.float32)
                if out.size and np.abs(tree.logprob[out] - logprobs).max() > 1e-6:
                    problems.append(f"{rid} call {info.call_id}: behaviour logprobs differ from the engine's")
                outputs |= set(out.tolist())
                n_tokens += int(out.size)
            if outputs != policy:
                problems.append(f"{rid}: policy tokens {len(policy)} != trained calls' output tokens {len(outputs)}")
    return n_rollouts, n_tokens, problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a run's output directory")
    args = p.parse_args(argv)
    if not (args.run / "calls.jsonl").is_file():
        print(
            f"check_trained_tokens: {args.run} is not a run's output directory (it has no calls.jsonl)", file=sys.stderr
        )
        return 2
    n_rollouts, n_tokens, problems = check_run(args.run)
    for problem in problems:
        print(problem)
    print(f"{args.run}: {n_rollouts} rollouts, {n_tokens} sampled tokens checked, {len(problems)} mismatches")
    for m in step_rows(read_metrics(args.run / "metrics.jsonl")):
        print(f"step {m['step']}: success {m.get('success_rate')}, ratio_mean {m.get('train/ratio_mean')}, "
              f"clip_frac {m.get('train/clip_frac')}")  # fmt: skip
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
