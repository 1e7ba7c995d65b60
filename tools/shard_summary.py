"""Summarize trajectory shards: rollouts, calls, tokens, path tokens per tree token, role mix, rewards, timeouts,
excluded evaluations. Shards that fail validation are listed, not fatal.

    python -m tools.shard_summary runs/x/shards/            # text
    python -m tools.shard_summary a.h5 b.h5 --json          # machine-readable
    python -m tools.shard_summary runs/x/shards/ --png summary.png

Exit status 1 when some shard is unreadable (it is listed with the reason), 2 when there is none.

Dedup ratio = tokens if every root-to-leaf path were expanded into its own sequence / tree tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from gyre.store.reader import Shard, read_shard
from gyre.store.schema import GRADE_STATUSES, ShardError
from gyre.store.stream import list_complete_shards
from gyre.traj.tree import ROLES


def expanded_tokens_per_rollout(shard: Shard) -> np.ndarray:
    """Per rollout: sum over its leaves of (depth + 1), the tokens of all its paths laid out separately."""
    t, r = shard.tokens, shard.rollouts
    n = t["token_id"].shape[0]
    first = np.repeat(r["token_offset"], r["n_tokens"])
    parent = t["parent"].astype(np.int64)
    has_child = np.zeros(n, dtype=bool)
    has_child[(first + parent)[parent >= 0]] = True
    rollout_of = np.repeat(np.arange(shard.n_rollouts), r["n_tokens"])
    return np.bincount(rollout_of[~has_child], weights=t["depth"][~has_child] + 1.0, minlength=shard.n_rollouts)


def shard_paths(inputs: list[Path]) -> list[Path]:
    out: list[Path] = []
    for p in inputs:
        out += list_complete_shards(p) if p.is_dir() else [p]
    return out


def _stats(values: np.ndarray) -> dict[str, float] | None:
    if values.size == 0:
        return None
    q = np.quantile(values, [0.0, 0.25, 0.5, 0.75, 1.0])
    return {"n": int(values.size), "mean": float(values.mean()), "std": float(values.std()), "min": float(q[0]),
            "p25": float(q[1]), "median": float(q[2]), "p75": float(q[3]), "max": float(q[4])}  # fmt: skip


def load(paths: list[Path]) -> tuple[list[Shard], list[dict[str, str]]]:
    """Readable shards, and the unreadable ones with the reason."""
    shards, unreadable = [], []
    for p in paths:
        try:
            shards.append(read_shard(p))
        except (ShardError, OSError) as e:
            unreadable.append({"path": str(p), "reason": getattr(e, "problem", str(e))})
    return shards, unreadable


def summarize(shards: list[Shard], unreadable: list[dict[str, str]]) -> dict[str, Any]:
    def cat(table: str, column: str) -> np.ndarray:
        return np.concatenate([getattr(s, table)[column] for s in shards]) if shards else np.zeros(0)

    status = cat("rollouts", "grade_status").astype(int)
    excluded = cat("rollouts", "excluded").astype(bool)
    tree_tokens = cat("rollouts", "n_tokens").astype(np.int64)
    expanded = np.concatenate([expanded_tokens_per_rollout(s) for s in shards]) if shards else np.zeros(0)
    token_role, policy = cat("tokens", "role").astype(int), cat("tokens", "policy").astype(bool)
    call_role, call_trained = cat("calls", "role").astype(int), cat("calls", "trained").astype(bool)
    call_excluded = cat("calls", "exclusion_reason").astype(str) != ""
    rewards = cat("rollouts", "reward").astype(np.float64)
    trained = ~excluded
    return {
        "shards": [str(s.path) for s in shards],
        "unreadable_shards": unreadable,
        "runs": sorted({str(s.attrs["run_id"]) for s in shards}),
        "steps": sorted({int(s.attrs["step"]) for s in shards}),
        "rollouts": {
            "total": int(status.size),
            "trained": int(trained.sum()),
            "grade_status": {name: int((status == code).sum()) for code, name in enumerate(GRADE_STATUSES)},
            "timeouts": int((status == GRADE_STATUSES.index("timeout")).sum()),
            "excluded": int(excluded.sum()),
            "exclusion_reasons": dict(Counter(str(x) for x in cat("rollouts", "exclusion_reason")[excluded])),
            "groups": len(set(cat("rollouts", "group_id").tolist())),
        },
        "calls": {
            "total": int(call_role.size),
            "trained": int(call_trained.sum()),
            "by_role": {name: int((call_role == code).sum()) for code, name in enumerate(ROLES)},
            "excluded": int(call_excluded.sum()),
            "exclusion_reasons": dict(Counter(str(x) for x in cat("calls", "exclusion_reason")[call_excluded])),
        },
        "tokens": {
            "tree": int(tree_tokens.sum()),
            "expanded": int(expanded.sum()),
            "path_tokens_per_tree_token": float(expanded.sum() / tree_tokens.sum()) if tree_tokens.sum() else None,
            "policy": int(policy.sum()),
            "with_loss_weight": int((cat("tokens", "loss_weight") > 0).sum()),
            "per_rollout": _stats(tree_tokens.astype(np.float64)),
            "by_role": {
                name: {
                    "context": int(((token_role == code) & ~policy).sum()),
                    "policy": int(((token_role == code) & policy).sum()),
                }
                for code, name in enumerate(ROLES)
            },
        },
        "reward": _stats(rewards[trained]),
        "reward_histogram": _histogram(rewards[trained]),
        "advantage": _stats(cat("rollouts", "advantage").astype(np.float64)[trained]),
    }


def _histogram(values: np.ndarray, bins: int = 10) -> dict[str, list[float]] | None:
    if values.size == 0:
        return None
    counts, edges = np.histogram(values, bins=bins)
    return {"edges": edges.tolist(), "counts": counts.tolist()}


def format_text(s: dict[str, Any]) -> str:
    r, c, t = s["rollouts"], s["calls"], s["tokens"]
    lines = [
        f"shards: {len(s['shards'])} readable, {len(s['unreadable_shards'])} unreadable; runs {s['runs']} steps {s['steps']}",
        f"rollouts: {r['total']} in {r['groups']} groups; trained {r['trained']}, excluded {r['excluded']}; "
        + ", ".join(f"{k} {v}" for k, v in r["grade_status"].items()),
        f"calls: {c['total']} ({c['trained']} trained); by role: "
        + ", ".join(f"{k} {v}" for k, v in c["by_role"].items() if v),
        f"tokens: tree {t['tree']:,}, expanded paths {t['expanded']:,}, path tokens per tree token "
        + (f"{t['path_tokens_per_tree_token']:.2f}x" if t["path_tokens_per_tree_token"] else "n/a")
        + f"; policy {t['policy']:,}, with loss weight {t['with_loss_weight']:,}",
        "role mix (tree tokens, context/policy): "
        + ", ".join(
            f"{k} {v['context']:,}/{v['policy']:,}" for k, v in t["by_role"].items() if v["context"] + v["policy"]
        ),
    ]
    if s["reward"]:
        q = s["reward"]
        lines.append(
            f"reward (trained rollouts): mean {q['mean']:.3f} std {q['std']:.3f} min {q['min']:.3f} "
            f"median {q['median']:.3f} max {q['max']:.3f}"
        )
    lines.append(f"excluded calls: {c['excluded']}")
    lines += [f"  {n} x {reason}" for reason, n in c["exclusion_reasons"].items()]
    lines.append(f"timeouts: {r['timeouts']} (graded from the preserved workspace)")
    lines.append(f"excluded evaluations: {r['excluded']}")
    lines += [f"  {n} x {reason}" for reason, n in r["exclusion_reasons"].items()]
    lines += [f"unreadable shard {u['path']}: {u['reason']}" for u in s["unreadable_shards"]]
    return "\n".join(lines)


def plot_summary(s: dict[str, Any], shards: list[Shard], out: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: renders with Agg, no display needed

    from tools.plot_tree import ROLE_COLOURS

    fig = Figure(figsize=(11, 7.5))
    ax = fig.subplots(2, 2)
    hist = s["reward_histogram"]
    if hist:
        e = np.asarray(hist["edges"])
        ax[0, 0].bar(e[:-1], hist["counts"], width=np.diff(e), align="edge", color="#4c72b0", edgecolor="white")
    ax[0, 0].set(title="reward of trained rollouts", xlabel="reward", ylabel="rollouts")
    grades = s["rollouts"]["grade_status"]
    ax[0, 1].bar(list(grades), list(grades.values()), color=["#55a868", "#dd8452", "#c44e52"])
    ax[0, 1].set(title=f"grade status ({s['rollouts']['excluded']} excluded)", ylabel="rollouts")
    roles = [k for k, v in s["tokens"]["by_role"].items() if v["context"] + v["policy"]]
    ctx = [s["tokens"]["by_role"][k]["context"] for k in roles]
    pol = [s["tokens"]["by_role"][k]["policy"] for k in roles]
    colours = [ROLE_COLOURS[k] for k in roles]
    ax[1, 0].bar(roles, ctx, color=colours, alpha=0.4, label="context")
    ax[1, 0].bar(roles, pol, bottom=ctx, color=colours, label="policy")
    ax[1, 0].set(title="tree tokens by role (light: context, solid: policy)", ylabel="tokens")
    ax[1, 0].tick_params(axis="x", labelrotation=20)
    tree, expanded = [], []
    for shard in shards:
        tree += shard.rollouts["n_tokens"].tolist()
        expanded += expanded_tokens_per_rollout(shard).tolist()
    ax[1, 1].scatter(tree, expanded, s=14, color="#8172b2")
    if tree:
        hi = max(max(tree), max(expanded))
        ax[1, 1].plot([0, hi], [0, hi], color="grey", lw=0.8, ls="--", label="no sharing")
        ax[1, 1].legend(loc="upper left")
    ratio = s["tokens"]["path_tokens_per_tree_token"]
    ax[1, 1].set(
        title=f"per rollout: expanded paths vs tree ({ratio or 0:.2f} path tokens per tree token)",
        xlabel="tree tokens",
        ylabel="expanded tokens",
    )
    fig.suptitle(
        f"{len(shards)} shard(s): {s['rollouts']['total']} rollouts, {s['calls']['total']} calls, {s['tokens']['tree']:,} tree tokens"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", type=Path, nargs="+", help="shard files or directories of shards")
    ap.add_argument("--json", action="store_true", help="print JSON instead of text")
    ap.add_argument("--png", type=Path, help="also draw a summary figure to this PNG")
    args = ap.parse_args(argv)
    paths = shard_paths(args.inputs)
    if not paths:
        print(f"no shards (*.h5) in {', '.join(map(str, args.inputs))}", file=sys.stderr)
        return 2
    shards, unreadable = load(paths)
    summary = summarize(shards, unreadable)
    print(json.dumps(summary, indent=2) if args.json else format_text(summary))
    if args.png:
        plot_summary(summary, shards, args.png)
    return 1 if unreadable else 0


if __name__ == "__main__":
    sys.exit(main())
