"""Registering the schema with Hydra, checking command-line keys, composing configs in code.

Imports no torch/megatron/sglang/mooncake.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from gyre.config.schema import RunConfig
from gyre.errors import UserError

SCHEMA_NAME = "gyre_schema"
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


class ConfigKeyError(UserError, KeyError):
    """An override names a key the schema does not have."""

    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return str(self.args[0])


def register_configs() -> None:
    ConfigStore.instance().store(name=SCHEMA_NAME, node=RunConfig)


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _resolve_type(field: dataclasses.Field, owner: type) -> Any:
    import typing

    hints = typing.get_type_hints(owner)
    return hints.get(field.name)


def check_key(dotted: str, schema: type = RunConfig) -> None:
    """Raise ConfigKeyError naming the bad part of `dotted` and the valid keys at that level."""
    cls: Any = schema
    walked: list[str] = []
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(cls):
            return  # inside a list/dict value: nothing more to check
        fields = _fields(cls)
        if part not in fields:
            where = ".".join(walked) or "the top level"
            valid = sorted(fields)
            close = difflib.get_close_matches(part, valid, n=1)
            hint = f" Did you mean '{'.'.join([*walked, close[0]])}'?" if close else ""
            raise ConfigKeyError(
                f"unknown config key '{dotted}': '{part}' is not a key of {where}. "
                f"Valid keys there: {', '.join(valid)}.{hint}"
            )
        walked.append(part)
        cls = _resolve_type(fields[part], cls)


LIST_KEYS = ("logger",)  # list-valued keys that also take one bare value: logger=tensorboard


def normalize_overrides(overrides: list[str]) -> list[str]:
    """`logger=tensorboard` -> `logger=[tensorboard]` (a list field); sweeps (`a,b`) and lists pass as given."""
    out = []
    for item in overrides:
        key, eq, value = item.partition("=")
        if eq and key in LIST_KEYS and value and not value.startswith("[") and "," not in value:
            item = f"{key}=[{value}]"
        out.append(item)
    return out


def check_overrides(overrides: list[str]) -> None:
    """Check `key=value` command-line overrides; Hydra's own `hydra.*` keys and groups pass through."""
    for item in overrides:
        if "=" not in item or item.startswith(("hydra.", "hydra/", "+hydra", "~hydra", "-")):
            continue
        key = item.split("=", 1)[0].lstrip("+~")
        if "/" in key or key in ("defaults",):
            continue
        check_key(key)


def compose(overrides: list[str] | None = None, config_name: str = "config") -> RunConfig:
    """Compose conf/<config_name>.yaml with overrides into a typed RunConfig (for tests and tools)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = normalize_overrides(list(overrides or []))
    check_overrides(overrides)
    register_configs()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = hydra_compose(config_name=config_name, overrides=overrides)
    return to_run_config(cfg)


def to_run_config(cfg: Any) -> RunConfig:
    """A resolved DictConfig -> the typed dataclass tree (interpolations such as ${now:} resolved)."""
    container = OmegaConf.to_container(cfg, resolve=True)
    if isinstance(container, dict):
        container.pop("hydra", None)
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), container)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]
