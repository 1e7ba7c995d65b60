"""Per-step metrics: one JSON object per line in metrics.jsonl (the source of truth), the same rows to the
experiment trackers `logger` names (gyre/tracking.py), and a PNG of the learning curve."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gyre.tracking import Tracker


class MetricsWriter:
    def __init__(self, output_dir: str | Path, trackers: Sequence[Tracker] = ()) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        self.trackers = list(trackers)
        self.events: dict[str, int] = {}  # rows seen per event kind: each kind's own x axis in the trackers

    def write(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
        if self.trackers:
            self._track(row)

    def _track(self, row: dict[str, Any]) -> None:
        from gyre.tracking import scalars_of

        kind = row.get("event", "step" if "step" in row else "row")
        scalars = scalars_of({k: v for k, v in row.items() if k != "event" and not (kind == "step" and k == "step")})
        for t in self.trackers:
            if kind == "step":
                t.step(int(row["step"]), scalars)
            elif kind == "summary":
                t.summary(row)
            else:
                t.event(str(kind), self.events.get(str(kind), 0), scalars, row)
        if kind not in ("step", "summary"):
            self.events[str(kind)] = self.events.get(str(kind), 0) + 1

    def image(self, name: str, png: Path) -> None:
        for t in self.trackers:
            t.image(name, png)

    def close(self) -> None:
        for t in self.trackers:
            t.close()
        self.trackers = []


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_learning_curve(
    rows: list[dict[str, Any]], png_path: str | Path, eval_rows: Sequence[dict[str, Any]] = ()
) -> Path:
    """Reward and success rate per step (with a 3-step moving average of success); with `eval_rows`, held-out
    pass@1 at each evaluated weight version (version v: the weights after v steps, drawn at step v - 0.5)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, [r["reward_mean"] for r in rows], "o-", label="reward (partial credit)")
    ax.plot(steps, [r["success_rate"] for r in rows], "s-", label="success rate")
    if len(rows) >= 3:
        sr = [r["success_rate"] for r in rows]
        avg = [sum(sr[max(0, i - 2) : i + 1]) / len(sr[max(0, i - 2) : i + 1]) for i in range(len(sr))]
        ax.plot(steps, avg, "--", color="gray", label="success, 3-step mean")
    held = [r for r in eval_rows if r.get("pass@1") is not None]
    if held:
        x = [r["version"] - 0.5 for r in held]
        ax.plot(x, [r["pass@1"] for r in held], "D-", color="tab:red", label="held-out pass@1 (eval)")
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    n = rows[-1].get("n_rollouts", "?") if rows else "?"
    ax.set_title(f"Gyre embedded run: {len(rows)} steps, {n} rollouts/step")
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return Path(png_path)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
