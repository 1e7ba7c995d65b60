"""Sampling task instances from the registered families, deterministically by seed."""

from __future__ import annotations

import random
from collections.abc import Sequence

from gyre.tasks.families import FAMILIES, get_family
from gyre.tasks.task import Task


def sample_tasks(families: Sequence[str] | None, n: int, seed: int | random.Random) -> list[Task]:
    """`n` tasks, each from a family chosen uniformly from `families` (None = all registered)."""
    names = list(families) if families is not None else sorted(FAMILIES)
    if not names:
        raise ValueError(f"no task families given; set tasks.families to some of {sorted(FAMILIES)}")
    samplers = [get_family(name) for name in names]
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    return [rng.choice(samplers)(rng) for _ in range(n)]
