"""Write docs/configuration.md from the config schema, so that the reference cannot drift from the code.

    python -m tools.config_reference            # rewrite docs/configuration.md
    python -m tools.config_reference --check    # exit 1 when the file differs from what the schema gives

Each key's type, default and domain come from the dataclasses of gyre/config/schema.py (the domain from
`ranged`/`choice`, gyre/config/domain.py); its meaning from the comments beside and above the field in the
source, and each section's introduction from its class docstring. tests/test_docs.py runs the check.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import sys
from pathlib import Path
from typing import Any

from gyre.config import schema
from gyre.config.domain import OneOf, Range, domain_of

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "configuration.md"

HEADER = """# Configuration reference

Generated from `gyre/config/schema.py` by `python -m tools.config_reference` (a test fails when this file
and the schema differ): every key, its type, default and domain, and what it means. YAML in `conf/` only
sets values; a Hydra override sets any key: `python -m launch.run rl.group_size=4 tasks.pool_size=0`.
Presets are config groups: `engine=sglang`, `harness=claude_code`, `tasks=swebench_real`,
`cluster=slurm_cpu`, `logger=[tensorboard,wandb]`.

Every value is checked before anything starts. A mistyped key is refused naming the valid ones, and a value
outside its domain naming the key, the value and the domain:

```
$ python -m launch.run rl.gruop_size=4
gyre: unknown config key 'rl.gruop_size': 'gruop_size' is not a key of rl. Valid keys there: ... Did you mean 'rl.group_size'?
$ python -m launch.run rl.group_size=1
gyre: rl.group_size=1: must be >= 2 (advantages compare a group's rollouts: one alone trains nothing)
```
"""


def field_comments(cls: type) -> dict[str, str]:
    """The comment lines right above each field of `cls` (or of the class it extends) and the comment at the end
    of its line."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            out |= _own_field_comments(base)
    return out


def _own_field_comments(cls: type) -> dict[str, str]:
    lines, first = inspect.getsourcelines(cls)
    tree = ast.parse("".join(lines))
    body = tree.body[0].body  # type: ignore[attr-defined]
    out: dict[str, str] = {}
    for node in body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        i = node.lineno - 1
        above: list[str] = []
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#"):
            above.insert(0, lines[j].strip().lstrip("#").strip())
            j -= 1
        line = lines[node.end_lineno - 1] if node.end_lineno else lines[i]
        trailing = _trailing_comment(line)
        out[node.target.id] = " ".join([*above, *([trailing] if trailing else [])])
    return out


def _trailing_comment(line: str) -> str:
    """The `# ...` at the end of a source line, outside string literals."""
    quote = ""
    for k, ch in enumerate(line):
        if quote:
            if ch == quote and line[k - 1] != "\\":
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return line[k + 1 :].strip()
    return ""


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def show_value(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    if isinstance(value, (list, dict)) and not value:
        return "`[]`" if isinstance(value, list) else "`{}`"
    return f"`{value}`"


def show_type(f: dataclasses.Field) -> str:
    return str(f.type).replace("|", "or").replace("  ", " ")


def show_domain(f: dataclasses.Field) -> str:
    domain = domain_of(f)
    if isinstance(domain, OneOf):
        return "one of " + ", ".join(f"`{c}`" for c in domain.choices)
    if isinstance(domain, Range):
        return str(domain) + (f" ({domain.why})" if domain.why else "")
    enum_type = _enum_type(f)
    if enum_type is not None:
        return "one of " + ", ".join(f"`{m.value}`" for m in enum_type)
    return ""


def _enum_type(f: dataclasses.Field) -> type[enum.Enum] | None:
    name = str(f.type).split("|")[0].strip()
    found = getattr(schema, name, None)
    return found if isinstance(found, type) and issubclass(found, enum.Enum) else None


def is_section(f: dataclasses.Field) -> bool:
    value = default_of(f)
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def section(cls: type, prefix: str) -> list[str]:
    """A table of `cls`'s plain fields, then the sections under it."""
    comments = field_comments(cls)
    doc = inspect.cleandoc(cls.__doc__) if cls.__doc__ and cls.__doc__ != _dataclass_doc(cls) else ""
    title = prefix.rstrip(".") or "top level"
    out = [f"## `{title}`" if prefix else "## Top level", ""]
    if doc:
        out += [" ".join(doc.split()), ""]
    out += ["| key | type | default | domain | meaning |", "|---|---|---|---|---|"]
    subsections: list[tuple[type, str]] = []
    for f in dataclasses.fields(cls):
        if is_section(f):
            subsections.append((type(default_of(f)), f"{prefix}{f.name}."))
            continue
        value = default_of(f)
        if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            subsections.append((type(value[0]), f"{prefix}{f.name}.N."))
            value = f"{len(value)} x {type(value[0]).__name__}"
            shown = value
        else:
            shown = show_value(value)
        row = [f"`{prefix}{f.name}`", cell(show_type(f)), cell(shown), cell(show_domain(f)), cell(comments[f.name])]
        out.append("| " + " | ".join(row) + " |")
    out.append("")
    seen: set[str] = set()
    for sub_cls, sub_prefix in subsections:
        if sub_prefix not in seen:
            seen.add(sub_prefix)
            out += section(sub_cls, sub_prefix)
    return out


def _dataclass_doc(cls: type) -> str:
    """The docstring dataclasses writes for a class without one (its signature)."""
    return cls.__name__ + str(inspect.signature(cls)).replace(" -> None", "")


def render() -> str:
    lines = [HEADER, *section(schema.RunConfig, "")]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the file differs from the schema")
    parser.add_argument("--out", type=Path, default=OUT, help=f"where to write (default {OUT.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} differs from the schema: run `python -m tools.config_reference`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
