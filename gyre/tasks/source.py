"""Where a run's tasks come from (`tasks.source`): the built-in families, or a suite on disk.

    builtin   instances drawn from gyre/tasks/families.py (tasks.families), endless
    harbor    tasks.path: a directory of Harbor / Terminal-Bench task directories (gyre/tasks/harbor.py)
    swebench  tasks.path: a JSONL file of SWE-bench instances, snapshots in tasks.repos (gyre/tasks/swebench.py)

A suite on disk is a finite list of instances, split into train and held-out eval by a hash of each
instance id (tasks.eval_fraction; the split of an instance never changes as the suite grows), and
tasks.split chooses which one a run uses. Sampling is by seed (gyre/tasks/suite.py's TaskPool).

A task that cannot be loaded is skipped with its cause (Suite.skipped: the run prints them, its summary
and every shard's provenance list them); `tasks.strict=true` refuses the suite instead, and a run whose
usable tasks number fewer than `tasks.min_tasks` refuses to start. Both refusals are one SuiteError that
names every cause.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gyre.config.schema import TaskConfig, TaskSourceKind
from gyre.config.validate import ConfigValueError
from gyre.tasks.harbor import load_harbor_suite
from gyre.tasks.swebench import load_swebench_suite
from gyre.tasks.task import LOAD_ERRORS, SkippedTask, Task, TaskFormatError, load_error

CAUSES_SHOWN = 20  # a refusal names this many skipped tasks, then counts the rest


class SuiteError(ConfigValueError):
    """The configured suite cannot be used (strict and a task is bad, too few usable tasks, no suite at the
    path); the message names every cause. A ConfigValueError: the CLI prints it as one line, no traceback."""


@dataclass
class Suite:
    tasks: list[Task]
    skipped: list[SkippedTask] = field(default_factory=list)

    def skipped_causes(self) -> dict[str, str]:
        return {s.name: s.cause for s in self.skipped}


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


def build_environments(tasks: Sequence[Task], images: str = "") -> tuple[list[Task], list[SkippedTask]]:
    """Every task in its own built environment image (gyre/tasks/images.py), bases also from `images`; a task
    whose image cannot be built is skipped with the builder's cause."""
    from gyre.tasks.images import ImageBuilder, build_task_environment

    builder = ImageBuilder(stores=[resolve(images)] if images else [])
    built, skipped = [], []
    for task in tasks:
        try:
            built.append(build_task_environment(task, builder))
        except LOAD_ERRORS as e:
            skipped.append(SkippedTask(task.task_id, task.source_path, load_error(e)))
    return built, skipped


def read_suite(cfg: TaskConfig) -> Suite:
    """Every task of the configured suite that loads, and the skipped ones with their causes (no split, no
    strictness: tools/check_tasks reports them all). Raises SuiteError when there is no suite at the path."""
    if not cfg.path:
        raise SuiteError(f"tasks.source={cfg.source} needs tasks.path (a directory of tasks or a JSONL file)")
    try:
        if cfg.source == TaskSourceKind.harbor:
            tasks, skipped = load_harbor_suite(resolve(cfg.path), cfg.build_images)
        elif cfg.source == TaskSourceKind.swebench:
            repos = resolve(cfg.repos) if cfg.repos else None
            tasks, skipped = load_swebench_suite(resolve(cfg.path), repos, cfg.build_images)
        else:
            raise SuiteError(f"tasks.source={cfg.source!r}: choose one of {', '.join(TaskSourceKind)}")
        if cfg.build_images:
            tasks, unbuilt = build_environments(tasks, cfg.images)
            skipped += unbuilt
    except TaskFormatError as e:
        raise SuiteError(str(e)) from None
    return Suite(tasks, skipped)


def describe_skipped(skipped: Sequence[SkippedTask]) -> str:
    lines = [f"  {s.line()}" for s in skipped[:CAUSES_SHOWN]]
    if len(skipped) > CAUSES_SHOWN:
        lines.append(f"  ... and {len(skipped) - CAUSES_SHOWN} more")
    return "\n".join(lines)


def load_suite(cfg: TaskConfig) -> Suite | None:
    """The usable instances of the configured split, in a stable order, with the skipped ones; None for the
    endless built-in source. Refuses (SuiteError) under tasks.strict with any skipped task, or with fewer
    usable instances than tasks.min_tasks."""
    if cfg.source == TaskSourceKind.builtin:
        return None
    suite = read_suite(cfg)
    if suite.skipped and cfg.strict:
        raise SuiteError(
            f"tasks.strict=true and {len(suite.skipped)} of {len(suite.tasks) + len(suite.skipped)} tasks of "
            f"{cfg.path} cannot be used:\n{describe_skipped(suite.skipped)}\n"
            "fix them, remove them, or set tasks.strict=false to skip them"
        )
    chosen = select_split(suite.tasks, cfg.split, cfg.eval_fraction)
    if suite.tasks and not chosen:
        raise SuiteError(
            f"tasks.split={cfg.split} of {cfg.path} is empty ({len(suite.tasks)} instances, eval_fraction "
            f"{cfg.eval_fraction}); use tasks.split=all or another eval_fraction"
        )
    if len(chosen) < cfg.min_tasks:
        causes = f"; skipped:\n{describe_skipped(suite.skipped)}" if suite.skipped else ""
        raise SuiteError(
            f"{cfg.path}: {len(chosen)} usable tasks in tasks.split={cfg.split}, fewer than tasks.min_tasks="
            f"{cfg.min_tasks} ({len(suite.skipped)} skipped){causes}"
        )
    return Suite(chosen, suite.skipped)


def preflight_suite(cfg: TaskConfig) -> str:
    """Load the configured suite once before anything starts: raises SuiteError (one message naming every
    cause) when the run must not start; else what to tell the user ('' for the built-in source)."""
    suite = load_suite(cfg)
    if suite is None:
        return ""
    text = f"gyre: {len(suite.tasks)} tasks from {cfg.path} (tasks.split={cfg.split})"
    if suite.skipped:
        text += f", {len(suite.skipped)} skipped (tasks.strict=false):\n{describe_skipped(suite.skipped)}"
    return text


def load_instances(cfg: TaskConfig) -> list[Task] | None:
    """The instances of the configured split, in a stable order; None for the endless built-in source."""
    suite = load_suite(cfg)
    return None if suite is None else suite.tasks
