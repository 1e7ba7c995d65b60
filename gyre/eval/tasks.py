"""Which tasks an evaluation runs: the held-out split of the training suite, or a suite of its own."""

from __future__ import annotations

import dataclasses
import random

from gyre.config.schema import RunConfig
from gyre.tasks.source import load_suite
from gyre.tasks.suite import TaskPool, held_out_tasks
from gyre.tasks.task import Task


def eval_task_set(cfg: RunConfig, training: TaskPool | None = None) -> list[Task]:
    """The eval tasks, the same for every eval of a run (seeded by cfg.seed).

    held_out, builtin: eval.max_tasks instances of the training families and eval.held_out_families, drawn
    from another seed and never one of the training pool's (with tasks.pool_size=0 every step draws fresh
    instances, so nothing is held out from them but the families). held_out, a suite on disk: its
    tasks.split=eval. Otherwise eval.tasks.
    """
    e = cfg.eval
    if e.held_out and cfg.tasks.source == "builtin":
        families = list(dict.fromkeys([*cfg.tasks.families, *e.held_out_families]))
        return held_out_tasks(families, e.max_tasks, cfg.seed, training.tasks if training is not None else ())
    source = dataclasses.replace(cfg.tasks, split="eval") if e.held_out else e.tasks
    if source.source == "builtin":
        return held_out_tasks(source.families, e.max_tasks, cfg.seed)
    suite = load_suite(source)
    assert suite is not None  # a source on disk
    tasks = sorted(suite.tasks, key=lambda t: t.task_id)
    if e.max_tasks and e.max_tasks < len(tasks):
        tasks = random.Random(cfg.seed).sample(tasks, e.max_tasks)
    return tasks
