"""Sampling task instances from the registered families, deterministically by seed."""

from __future__ import annotations

import random
from collections.abc import Sequence

from gyre.config.schema import TaskConfig
from gyre.tasks.families import FAMILIES, get_family
from gyre.tasks.source import load_suite
from gyre.tasks.task import SkippedTask, Task


def sample_tasks(families: Sequence[str] | None, n: int, seed: int | random.Random) -> list[Task]:
    """`n` tasks, each from a family chosen uniformly from `families` (None = all registered)."""
    names = list(families) if families is not None else sorted(FAMILIES)
    if not names:
        raise ValueError(f"no task families given; set tasks.families to some of {sorted(FAMILIES)}")
    samplers = [get_family(name) for name in names]
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    return [rng.choice(samplers)(rng) for _ in range(n)]


class TaskPool:
    """The RL training set: `size` task instances drawn once, visited in epochs, each epoch shuffled.

    Step s takes instances s*n .. s*n+n-1 of the endless sequence epoch 0, epoch 1, ..., so every
    instance comes back once per epoch, as in training on a dataset. `size` 0 draws fresh instances
    for every step instead (nothing repeats). With `instances` (a suite on disk), the pool is a seeded
    sample of `size` of them (all of them when `size` is 0 or at least their number). `skipped`: the suite's
    tasks that could not be loaded (listed in the run's summary and every shard's provenance).
    """

    def __init__(
        self,
        families: Sequence[str] | None,
        size: int,
        seed: int,
        instances: Sequence[Task] | None = None,
        skipped: Sequence[SkippedTask] = (),
    ) -> None:
        if size < 0:
            raise ValueError(f"tasks.pool_size must be >= 0, got {size}")
        self.families = families
        self.seed = seed
        self.skipped = list(skipped)
        if instances is not None:
            if not instances:
                raise ValueError("the task source has no instances")
            chosen = list(instances) if not size or size >= len(instances) else random.Random(seed).sample(
                list(instances), size)  # fmt: skip
            self.tasks, self.size = chosen, len(chosen)
        else:
            self.tasks, self.size = (balanced_tasks(families, size, seed) if size else []), size
        self._orders: dict[int, list[int]] = {}

    @classmethod
    def from_config(cls, cfg: TaskConfig, seed: int) -> TaskPool:
        """The configured source's pool (gyre/tasks/source.py reads a suite on disk, skipping bad tasks)."""
        suite = load_suite(cfg)
        if suite is None:
            return cls(cfg.families, cfg.pool_size, seed)
        return cls(cfg.families, cfg.pool_size, seed, suite.tasks, suite.skipped)

    def skipped_causes(self) -> dict[str, str]:
        return {s.name: s.cause for s in self.skipped}

    def for_step(self, step: int, n: int) -> list[Task]:
        if not self.size:
            return sample_tasks(self.families, n, seed=self.seed * 100_003 + step)
        return [self.tasks[self._order(i // self.size)[i % self.size]] for i in range(step * n, step * n + n)]

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(self.size))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders[epoch] = order
        return self._orders[epoch]


def balanced_tasks(families: Sequence[str] | None, n: int, seed: int) -> list[Task]:
    """`n` tasks with the families in turn, so a small training set has every family in equal share."""
    names = list(families) if families is not None else sorted(FAMILIES)
    rng = random.Random(seed)
    return [sample_tasks([names[i % len(names)]], 1, rng)[0] for i in range(n)]


HELD_OUT_SEED = 7_919  # offset of the seed held-out instances are drawn from: never the training pool's


def held_out_tasks(families: Sequence[str], n: int, seed: int, exclude: Sequence[Task] = ()) -> list[Task]:
    """`n` built-in instances, families in turn, drawn from another seed than the training pool's, none of
    them one of `exclude` (the training pool's instances, compared by task id: same prompt and files)."""
    if n < 1:
        raise ValueError(f"held-out built-in instances are drawn: ask for at least 1, got {n}")
    seen = {t.task_id for t in exclude}
    rng = random.Random(seed * 1_000_003 + HELD_OUT_SEED)
    out: list[Task] = []
    for attempt in range(100 * n):
        task = sample_tasks([families[len(out) % len(families)]], 1, rng)[0]
        if task.task_id not in seen:
            seen.add(task.task_id)
            out.append(task)
            if len(out) == n:
                return out
        if attempt == 100 * n - 1:
            break
    raise ValueError(f"could not draw {n} held-out instances of {list(families)} outside the training pool")
