"""The domain of each config field, declared once beside the field in gyre/config/schema.py:

    group_size: int = ranged(8, Range(low=2), why="...")     # a number in an interval
    backend: str = choice(EngineBackend.embedded, EngineBackend)  # one of an enum's values (or a list of them)

`check_fields` refuses a value outside its field's domain naming the key, the value and the domain; it runs
when a section is built (its __post_init__) and over the whole tree when a RunConfig is built, which is
where every config is loaded (gyre.config.load.to_run_config). Imports nothing of gyre.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from gyre.errors import UserError

DOMAIN = "domain"  # the dataclasses.field metadata key


class ConfigValueError(UserError, ValueError):
    """A config value is out of range or inconsistent with another."""


def fail(key: str, value: object, why: str) -> None:
    raise ConfigValueError(f"{key}={value!r}: {why}")


def _num(x: float) -> str:
    return f"{x:g}"


@dataclass(frozen=True)
class Range:
    """A number in [low, high] (either end open, either end absent)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    why: str = ""  # what the bounds mean, added to the refusal

    def contains(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"in {left}{_num(self.low)}, {_num(self.high)}{right}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_num(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_num(self.high)}"
        return "any number"

    def check(self, key: str, value: Any) -> None:
        if value is not None and not self.contains(value):
            fail(key, value, f"must be {self}" + (f" ({self.why})" if self.why else ""))

    def outside(self, integer: bool) -> list[float]:
        """Values just outside the domain (for tests generated from the schema)."""
        step = 1 if integer else 0.5
        below = [] if self.low is None else [self.low if self.low_open else self.low - step]
        above = [] if self.high is None else [self.high if self.high_open else self.high + step]
        return [int(v) if integer else float(v) for v in below + above]


@dataclass(frozen=True)
class OneOf:
    """One of a few strings; a list field: each of its items."""

    choices: tuple[str, ...]
    what: str = ""  # names the kind of thing in the refusal: "unknown engine backend; choose one of ..."

    def check(self, key: str, value: Any) -> None:
        unknown = f"unknown {self.what}; " if self.what else ""
        allowed = ", ".join(self.choices)
        if isinstance(value, (list, tuple)):
            if bad := sorted(set(value) - set(self.choices)):
                fail(key, list(value), f"unknown {bad}; choose from {allowed}")
        elif value not in self.choices:
            fail(key, value, f"{unknown}choose one of {allowed}")


Domain = Range | OneOf

POSITIVE = Range(low=0, low_open=True)
NON_NEGATIVE = Range(low=0)
AT_LEAST_1 = Range(low=1)
UNIT_INTERVAL = Range(0, 1)
PORT = Range(0, 65535, why="a TCP port, or 0 to pick a free one")
SEED = Range(low=0, why="numpy and torch seeds are non-negative")


def ranged(default: Any, domain: Range, why: str = "") -> Any:
    """A numeric field with its domain (`why`: what its bounds mean, e.g. what 0 turns off)."""
    domain = dataclasses.replace(domain, why=why) if why else domain
    return dataclasses.field(default=default, metadata={DOMAIN: domain})


def choice(default: Any, choices: tuple[str, ...] | type[enum.StrEnum], what: str = "") -> Any:
    """A string field that takes one of `choices`, a tuple or the values of a StrEnum (a list-valued field:
    `default` is a factory)."""
    domain = OneOf(tuple(str(c) for c in choices), what)
    if callable(default):
        return dataclasses.field(default_factory=default, metadata={DOMAIN: domain})
    return dataclasses.field(default=default, metadata={DOMAIN: domain})


def domain_of(f: dataclasses.Field) -> Domain | None:
    return f.metadata.get(DOMAIN)


def check_fields(node: Any, prefix: str = "") -> None:
    """Every field of the dataclass `node` in its domain, and so for the dataclasses under it (lists of them
    included), keys dotted from `prefix`."""
    for f in dataclasses.fields(node):
        key, value = f"{prefix}{f.name}", getattr(node, f.name)
        if (domain := domain_of(f)) is not None:
            domain.check(key, value)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if dataclasses.is_dataclass(item) and not isinstance(item, type):
                check_fields(item, f"{key}.{i}." if isinstance(value, list) else f"{key}.")
