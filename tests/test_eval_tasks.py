"""Held-out eval tasks: never an instance of the training pool, a family it never trains on."""

import pytest

from gyre.config.load import compose
from gyre.eval.tasks import eval_task_set
from gyre.tasks.suite import TaskPool, held_out_tasks

pytestmark = pytest.mark.unit


def test_builtin_held_out_set_is_disjoint_from_the_pool_and_has_an_untrained_family():
    cfg = compose(["eval.max_tasks=12", "tasks.pool_size=8"])
    pool = TaskPool.from_config(cfg.tasks, seed=cfg.seed)
    tasks = eval_task_set(cfg, pool)
    assert len(tasks) == 12 and len({t.task_id for t in tasks}) == 12
    assert {t.task_id for t in tasks}.isdisjoint(t.task_id for t in pool.tasks)
    families = {t.family for t in tasks}
    assert set(cfg.tasks.families) <= families and set(cfg.eval.held_out_families) <= families
    assert {t.family for t in pool.tasks}.isdisjoint(cfg.eval.held_out_families)
    assert [t.task_id for t in eval_task_set(cfg, pool)] == [t.task_id for t in tasks]  # the same every eval


def test_held_out_draw_skips_excluded_instances():
    first = held_out_tasks(["write_value"], 5, seed=3)
    again = held_out_tasks(["write_value"], 5, seed=3, exclude=first[:2])
    assert {t.task_id for t in again}.isdisjoint(t.task_id for t in first[:2])
    with pytest.raises(ValueError):
        held_out_tasks(["write_value"], 0, seed=3)


def test_suite_on_disk_held_out_is_its_eval_split(tmp_path):
    cfg = compose(["tasks=harbor_examples", "tasks.split=train", "eval.max_tasks=0"])
    train = TaskPool.from_config(cfg.tasks, seed=cfg.seed)
    tasks = eval_task_set(cfg, train)
    assert tasks and {t.task_id for t in tasks}.isdisjoint(t.task_id for t in train.tasks)
