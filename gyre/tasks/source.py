"""Where a run's tasks come from (`tasks.source`): the built-in families, or a suite on disk.

    builtin   instances drawn from gyre/tasks/families.py (tasks.families), endless
    harbor    tasks.path: a directory of Harbor / Terminal-Bench task directories (gyre/tasks/harbor.py)
    swebench  tasks.path: a JSONL file of SWE-bench instances, snapshots in tasks.repos (gyre/tasks/swebench.py)

A suite on disk is a finite list of instances, split into train and held-out eval by a hash of each
instance id (tasks.eval_fraction; the split of an instance never changes as the suite grows), and
tasks.split chooses which one a run uses. Sampling is by seed (gyre/tasks/suite.py's TaskPool).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from gyre.config.schema import TaskConfig
from gyre.tasks.harbor import load_harbor_tasks
from gyre.tasks.swebench import load_swebench_tasks
from gyre.tasks.task import Task

SOURCES = ("builtin", "harbor", "swebench")
SPLITS = ("train", "eval", "all")


def split_of(instance_id: str, eval_fraction: float) -> str:
    """ "eval" for a stable `eval_fraction` share of instance ids, else "train"."""
    h = int.from_bytes(hashlib.sha256(instance_id.encode()).digest()[:8], "big") / 2**64
    return "eval" if h < eval_fraction else "train"


def select_split(tasks: Sequence[Task], split: str, eval_fraction: float) -> list[Task]:
    if split == "all":
        return list(tasks)
    return [t for t in tasks if split_of(t.task_id, eval_fraction) == split]


def resolve(path: str, base: Path | None = None) -> Path:
    """A relative tasks.path is relative to the checkout (where `make run` runs), not Hydra's run directory."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else (base or Path.cwd()) / p


def build_environments(tasks: Sequence[Task], images: str = "") -> list[Task]:
    """Every task in its own built environment image (gyre/tasks/images.py), bases also from `images`."""
    from gyre.tasks.images import ImageBuilder, build_task_environment

    builder = ImageBuilder(stores=[resolve(images)] if images else [])
    return [build_task_environment(t, builder) for t in tasks]


def load_instances(cfg: TaskConfig) -> list[Task] | None:
    """The instances of the configured split, in a stable order; None for the endless built-in source."""
    if cfg.source == "builtin":
        return None
    if not cfg.path:
        raise ValueError(f"tasks.source={cfg.source} needs tasks.path (a directory of tasks or a JSONL file)")
    if cfg.source == "harbor":
        tasks = load_harbor_tasks(resolve(cfg.path), build_images=cfg.build_images)
        if cfg.build_images:
            tasks = build_environments(tasks, cfg.images)
    elif cfg.source == "swebench":
        tasks = load_swebench_tasks(resolve(cfg.path), resolve(cfg.repos) if cfg.repos else None)
    else:
        raise ValueError(f"tasks.source={cfg.source!r}: choose one of {', '.join(SOURCES)}")
    chosen = select_split(tasks, cfg.split, cfg.eval_fraction)
    if not chosen:
        raise ValueError(
            f"tasks.split={cfg.split} of {cfg.path} is empty ({len(tasks)} instances, eval_fraction "
            f"{cfg.eval_fraction}); use tasks.split=all or another eval_fraction"
        )
    return chosen
