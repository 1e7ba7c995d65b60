"""Every config field's domain, declared once in the schema, refused outside it before anything starts.

The cases are generated from the schema: every numeric field at values just outside its declared domain, every
choice at a value it does not list. Each goes through what launch.run does with Hydra's composed config
(gyre.config.load.to_run_config, then launch.run.check_before_start), which starts nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import re
import typing
from collections.abc import Iterator
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ValidationError

from gyre.config.domain import OneOf, Range, domain_of
from gyre.config.load import compose, register_configs, to_run_config
from gyre.config.schema import ModelInit, RunConfig, Scheduler
from gyre.config.validate import ConfigValueError
from launch.run import check_before_start

pytestmark = pytest.mark.unit
NUMBERS = (int, float)
NOT_A_CHOICE = "not-a-choice"


@dataclasses.dataclass(frozen=True)
class SchemaField:
    key: str  # dotted, as on the command line
    type: Any  # the field's type, Optional unwrapped
    field: dataclasses.Field


def schema_fields(cls: type = RunConfig, prefix: str = "") -> Iterator[SchemaField]:
    """Every leaf field under `cls`; a list of dataclasses (cluster.satellites) through its first item."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind, key = hints[f.name], f"{prefix}{f.name}"
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if typing.get_origin(kind) is list and args and dataclasses.is_dataclass(args[0]):
            yield from schema_fields(args[0], f"{key}.0.")
        elif dataclasses.is_dataclass(kind):
            yield from schema_fields(kind, f"{key}.")
        else:
            yield SchemaField(key, args[0] if typing.get_origin(kind) is not list and args else kind, f)


def is_number(f: SchemaField) -> bool:
    return f.type in NUMBERS


FIELDS = list(schema_fields())
NUMERIC = [f for f in FIELDS if is_number(f)]
CHOICES = [f for f in FIELDS if isinstance(domain_of(f.field), OneOf)]
ENUMS = [f for f in FIELDS if isinstance(f.type, type) and issubclass(f.type, enum.Enum)]


def outside_cases() -> list[tuple[str, Any]]:
    return [(f.key, v) for f in NUMERIC for v in domain_of(f.field).outside(f.type is int)]


def choice_cases() -> list[tuple[str, Any]]:
    return [(f.key, [NOT_A_CHOICE] if typing.get_origin(f.type) is list else NOT_A_CHOICE) for f in CHOICES]


@pytest.fixture(scope="module")
def composed() -> DictConfig:
    """The default config as Hydra composes it for launch.run (conf/config.yaml over the schema)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from gyre.config.load import CONF_DIR

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = hydra_compose(config_name="config")
    GlobalHydra.instance().clear()
    return cfg


def load_and_check(composed: DictConfig, key: str, value: Any) -> None:
    """launch.run's path to the start line: the composed config with one value changed, loaded and checked."""
    cfg = copy.deepcopy(composed)
    OmegaConf.update(cfg, key, value, merge=False)
    check_before_start(to_run_config(cfg))


def test_every_numeric_field_declares_its_domain():
    undeclared = [f.key for f in NUMERIC if not isinstance(domain_of(f.field), Range)]
    assert not undeclared, f"numeric fields without a domain (gyre.config.domain.ranged): {undeclared}"
    assert len(NUMERIC) > 80 and len(CHOICES) > 20  # the walk reached every section


def test_the_defaults_are_inside_every_domain(composed):
    check_before_start(to_run_config(composed))
    for f in FIELDS:
        if (domain := domain_of(f.field)) is not None:
            default = f.field.default_factory() if callable(f.field.default_factory) else f.field.default
            domain.check(f.key, default)


@pytest.mark.parametrize(("key", "value"), outside_cases(), ids=lambda x: str(x))
def test_a_number_outside_its_domain_is_refused_naming_the_key(composed, key, value):
    with pytest.raises(ConfigValueError) as refused:
        load_and_check(composed, key, value)
    message = str(refused.value)
    assert message.startswith(f"{key}={value!r}: must be "), message


@pytest.mark.parametrize(("key", "value"), choice_cases(), ids=lambda x: str(x))
def test_an_unknown_choice_is_refused_with_the_allowed_ones(composed, key, value):
    field = next(f for f in CHOICES if f.key == key)
    with pytest.raises(ConfigValueError) as refused:
        load_and_check(composed, key, value)
    message = str(refused.value)
    assert message.startswith(f"{key}={value!r}: "), message
    assert ", ".join(domain_of(field.field).choices) in message


@pytest.mark.parametrize("key", [f.key for f in ENUMS])
def test_an_unknown_enum_value_is_refused_naming_the_key(composed, key):
    with pytest.raises(ValidationError, match=rf"Invalid value '{NOT_A_CHOICE}'[\s\S]*full_key: {key}"):
        load_and_check(composed, key, NOT_A_CHOICE)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rl.group_size=-3", "rl.group_size=-3: must be >= 2"),
        ("rl.group_size=0", "rl.group_size=0: must be >= 2"),
        ("rl.group_size=1", "rl.group_size=1: must be >= 2 (advantages compare a group's rollouts"),
        ("rl.groups_per_step=0", "rl.groups_per_step=0: must be >= 1"),
        ("steps=-1", "steps=-1: must be >= 1 (a run of no steps trains nothing)"),
        ("steps=0", "steps=0: must be >= 1"),
        ("rl.clip_eps_low=-0.5", "rl.clip_eps_low=-0.5: must be in [0, 1)"),
        ("sched.staleness=-1", "sched.staleness=-1: must be >= 0"),
        ("harness.temperature=-1", "harness.temperature=-1.0: must be >= 0"),
        ("cluster.satellites.1.nodes=0", "cluster.satellites.1.nodes=0: must be >= 1"),
        ("engine.backend=vllm", "engine.backend='vllm': unknown engine backend; choose one of embedded, sglang"),
    ],
)
def test_the_values_a_new_user_tried_are_refused_on_the_command_line_path(override, message):
    """compose() is launch.submit's path; what it refuses, launch.run's Hydra app refuses the same way."""
    with pytest.raises(ConfigValueError, match=re.escape(message)):
        compose([override])


def test_a_run_that_would_train_nothing_is_refused():
    for override in ("steps=0", "rl.group_size=0", "rl.group_size=1", "rl.groups_per_step=0"):
        with pytest.raises(ConfigValueError, match=override.split("=")[0]):
            compose([override])
    check_before_start(compose(["steps=1", "rl.group_size=2", "rl.groups_per_step=1"]))  # the smallest real run


def test_a_domain_says_what_it_is():
    assert str(Range(low=0, low_open=True)) == "> 0"
    assert str(Range(low=1)) == ">= 1"
    assert str(Range(0, 1, high_open=True)) == "in [0, 1)"
    assert Range(0, 1, low_open=True, high_open=True).outside(integer=False) == [0.0, 1.0]
    assert Range(low=2).outside(integer=True) == [1]
    with pytest.raises(ConfigValueError, match=r"logger=\['jsonl', 'mlflow'\]: unknown \['mlflow'\]"):
        OneOf(("jsonl", "wandb")).check("logger", ["jsonl", "mlflow"])


def test_task_families_are_the_registered_ones():
    with pytest.raises(
        ConfigValueError, match=r"tasks.families=\['write_value', 'bogus'\]: unknown \['bogus'\]; .*fix_value"
    ):
        check_before_start(compose(["tasks.families=[write_value,bogus]"]))
    with pytest.raises(ConfigValueError, match=r"warm_start.families=\['bogus'\]"):
        check_before_start(compose(["warm_start.families=[bogus]"]))
    with pytest.raises(ConfigValueError, match=r"tasks.families=\[\]: tasks.source=builtin needs families"):
        check_before_start(compose(["tasks.families=[]"]))


def test_a_choice_holds_a_plain_string_that_equals_its_enum_member():
    """Defaults too: a config's values pickle and load anywhere (torch.load(weights_only=True) of a checkpoint
    that records the model config refuses gyre's enum classes)."""
    cfg = RunConfig()
    for f in CHOICES:
        value = cfg
        for part in f.key.split("."):
            value = value[int(part)] if part.isdigit() else getattr(value, part)
        for item in value if isinstance(value, list) else [value]:
            assert type(item) is str, (f.key, type(item))
    assert cfg.scheduler == Scheduler.colocate and cfg.model.init == ModelInit.torch
