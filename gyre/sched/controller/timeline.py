"""What every cell did over the run, and the rollout level beside it: timeline.json and timeline.png.

Each cell is a row of segments coloured by role (rollout, train, switching, dead); the rollout level
(queued + running sessions) is drawn over them on a second axis, with the rollout capacity.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gyre.sched.controller.sessions import SlotCounts

COLOURS = {"rollout": "#4C72B0", "train": "#DD8452", "switching": "#8C8C8C", "dead": "#C44E52"}


@dataclass
class Segment:
    cell: int
    role: str
    start: float
    end: float


@dataclass
class Timeline:
    n_cells: int
    t0: float = field(default_factory=time.monotonic)
    segments: list[Segment] = field(default_factory=list)
    level: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, queued, running, capacity)
    _open: dict[int, tuple[str, float]] = field(default_factory=dict)

    def start_clock(self) -> None:
        """Time 0 is now (the run's start, after the cells came up)."""
        self.t0 = time.monotonic()
        self._open = {cell: (role, 0.0) for cell, (role, _) in self._open.items()}

    def now(self) -> float:
        return time.monotonic() - self.t0

    def set_role(self, cell: int, role: str) -> None:
        t = self.now()
        if cell in self._open:
            prev, start = self._open[cell]
            if prev == role:
                return
            self.segments.append(Segment(cell, prev, start, t))
        self._open[cell] = (role, t)

    def sample(self, queued: int, running: int, capacity: int) -> None:
        if self.level and self.level[-1][1:] == (queued, running, capacity):
            return
        self.level.append((self.now(), queued, running, capacity))

    def close(self) -> None:
        t = self.now()
        for cell, (role, start) in self._open.items():
            self.segments.append(Segment(cell, role, start, t))
        self._open = {}

    def role_seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.segments:
            out[s.role] = out.get(s.role, 0.0) + s.end - s.start
        return {k: round(v, 3) for k, v in out.items()}

    def save(self, out: Path, title: str, slots: Sequence[SlotCounts] = ()) -> Path:
        """`slots`: the rollout driver's counts at each change (training and eval sessions apart), kept in
        timeline.json as [t, queued_train, running_train, queued_eval, running_eval, capacity] rows."""
        self.close()
        data = {
            "segments": [asdict(s) for s in self.segments],
            "level": self.level,
            "role_seconds": self.role_seconds(),
            "slots": [[round(s.t - self.t0, 6), *astuple(s)[1:]] for s in slots],
        }
        (out / "timeline.json").write_text(json.dumps(data))
        return plot(self, out / "timeline.png", title)


def plot(tl: Timeline, png: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(10, 2.0 + 0.7 * tl.n_cells), dpi=110)
    for s in tl.segments:
        ax.broken_barh([(s.start, s.end - s.start)], (s.cell - 0.35, 0.7), color=COLOURS.get(s.role, "black"))
    ax.set_yticks(range(tl.n_cells), [f"cell {c}" + (" (core)" if c == 0 else "") for c in range(tl.n_cells)])
    ax.set_ylim(-0.6, tl.n_cells - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run started")
    if tl.level:
        lv = ax.twinx()
        ts = [p[0] for p in tl.level] + [tl.now()]
        lv.step(ts, [p[1] + p[2] for p in tl.level] + [tl.level[-1][1] + tl.level[-1][2]], "k-", where="post", lw=1.2)
        lv.step(ts, [p[3] for p in tl.level] + [tl.level[-1][3]], "k:", where="post", lw=1.0)
        lv.set_ylabel("sessions")
        lv.set_ylim(bottom=0)
    handles = [Patch(color=c, label=r) for r, c in COLOURS.items()]
    handles += [
        Line2D([], [], color="k", lw=1.2, label="queued + running"),
        Line2D([], [], color="k", ls=":", label="capacity"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=6, fontsize=8, frameon=False)
    ax.set_title(title)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(png)
    plt.close(fig)
    return png
