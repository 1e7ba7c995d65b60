"""Experiment trackers beside metrics.jsonl (`logger=jsonl|tensorboard|wandb`, several at once).

metrics.jsonl stays the source of truth; each tracker gets the same rows as they are written:
- a step row (`step` and no `event`, or `event: "step"`): every numeric value as a scalar at that step;
- an event row (`switch`, `engine_died`, `cell_died`, ...): its numeric values under `events/<event>/`,
  numbered per event kind (switch 0, 1, ...), and the row as text;
- the summary row: the run's summary;
- images (the learning curve, the timeline) at the end.
TensorBoard event files go to <output_dir>/tensorboard/<run name>/; W&B runs (offline by default: compute
nodes often have no internet; `wandb sync` them later) to <output_dir>/wandb/. One run per Hydra multirun
job, named by its overrides.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import sys
import tempfile
import types
from pathlib import Path
from typing import Any, Protocol

from gyre.config.schema import RunConfig

log = logging.getLogger(__name__)


class Tracker(Protocol):
    def step(self, step: int, scalars: dict[str, float]) -> None: ...
    def event(self, kind: str, index: int, scalars: dict[str, float], row: dict[str, Any]) -> None: ...
    def summary(self, row: dict[str, Any]) -> None: ...
    def image(self, name: str, png: Path) -> None: ...
    def close(self) -> None: ...


def scalars_of(row: dict[str, Any]) -> dict[str, float]:
    """The row's finite numbers (bools as 0/1), by key; nested dicts flattened with '/'."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out |= {f"{key}/{k}": v for k, v in scalars_of(value).items()}
        elif isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
            out[key] = float(value)
    return out


def _require(package: str) -> None:
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise ImportError(f"logger={package} needs the {package} package: pip install 'gyre[tracking]'")


class TensorBoardTracker:
    def __init__(self, logdir: Path) -> None:
        _require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = logdir
        self.writer = SummaryWriter(log_dir=str(logdir))

    def step(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)

    def event(self, kind: str, index: int, scalars: dict[str, float], row: dict[str, Any]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(f"events/{kind}/{key}", value, global_step=index)
        self.writer.add_text(f"events/{kind}", json.dumps(row, sort_keys=True), global_step=index)

    def summary(self, row: dict[str, Any]) -> None:
        self.writer.add_text("summary", json.dumps(row, sort_keys=True, default=str))

    def image(self, name: str, png: Path) -> None:
        from matplotlib.image import imread

        self.writer.add_image(name, imread(str(png))[..., :3], dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, directory: Path, name: str, project: str, mode: str, config: dict[str, Any]) -> None:
        _require("wandb")
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(project=project, name=name, dir=str(directory), mode=mode, config=config,
                              reinit="create_new")  # fmt: skip
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.defined: set[str] = set()

    def step(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({**scalars, "step": step})

    def event(self, kind: str, index: int, scalars: dict[str, float], row: dict[str, Any]) -> None:
        counter = f"events/{kind}/index"
        if kind not in self.defined:
            self.run.define_metric(counter)
            self.run.define_metric(f"events/{kind}/*", step_metric=counter)
            self.defined.add(kind)
        self.run.log({**{f"events/{kind}/{k}": v for k, v in scalars.items()}, counter: index})

    def summary(self, row: dict[str, Any]) -> None:
        self.run.summary.update({f"summary/{k}": v for k, v in scalars_of(row).items()})

    def image(self, name: str, png: Path) -> None:
        self.run.log({name: self.wandb.Image(str(png))})

    def close(self) -> None:
        self.run.finish()


# the temporary directories wandb makes when imported (tmp*wandb-media, tmp*wandb-artifacts in TMPDIR; a logged
# image is copied into the first): (module, attribute path) in wandb 0.31
WANDB_TEMPORARY_DIRS = (
    ("wandb.sdk.data_types._private", "MEDIA_TMP"),
    ("wandb.sdk.artifacts.artifact", "Artifact._TMP_DIR"),
)


def without_wandb() -> None:
    """Keep wandb out of this process: megatron.core's inference contexts import it when it is installed (for
    their own logging), which costs a rank 0.6 s of start-up, and wandb's temporary directories
    (tmp*wandb-media, tmp*wandb-artifacts) would stay in TMPDIR after a rank that MPI_Abort or a signal
    ends. Only for a rank that runs no tracker (gyre.sched.launch.job.run: every rank but a controller with
    logger=wandb): `import wandb` fails here from now on."""
    sys.modules.setdefault("wandb", None)  # None in sys.modules: the import system's "not importable"


def remove_wandb_temporary_dirs() -> None:
    """Remove wandb's temporary directories, as its atexit hooks would: a rank that leaves with os._exit
    (gyre.sched.launch.job.leave) skips them, and each run on the node would leave its two behind. Only as the
    process ends: a later run in it (a Hydra multirun) writes into them. Nothing when wandb was not imported."""
    if not isinstance(sys.modules.get("wandb"), types.ModuleType):
        return
    for module, path in WANDB_TEMPORARY_DIRS:
        found: Any = sys.modules.get(module)
        for name in path.split("."):
            found = getattr(found, name, None)
        if isinstance(found, tempfile.TemporaryDirectory):
            found.cleanup()


MAX_RUN_NAME = 200  # TensorBoard writes into a directory of this name: a file name holds 255 bytes at most


def run_name(cfg: RunConfig, output_dir: Path) -> str:
    """The run's name in every tracker; a long one (many overrides) is cut, with a hash of the whole kept."""
    name = cfg.tracking.run_name or output_dir.name
    if len(name.encode()) <= MAX_RUN_NAME:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{name.encode()[: MAX_RUN_NAME - 9].decode(errors='ignore')}-{digest}"


def open_trackers(cfg: RunConfig, output_dir: Path) -> list[Tracker]:
    """The trackers `logger` names beyond jsonl (which MetricsWriter always writes)."""
    name = run_name(cfg, output_dir)
    trackers: list[Tracker] = []
    if "tensorboard" in cfg.logger:
        trackers.append(TensorBoardTracker(output_dir / "tensorboard" / name.replace("/", "_")))
    if "wandb" in cfg.logger:
        from dataclasses import asdict

        t = cfg.tracking
        trackers.append(WandbTracker(output_dir, name, t.wandb_project, t.wandb_mode, asdict(cfg)))
    for t in trackers:
        log.info("logging run %r to %s", name, type(t).__name__)
    return trackers
