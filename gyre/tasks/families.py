"""Built-in task families: small coding-style edits a ~1M-parameter model can learn.

Every family copies or transforms short strings from the prompt or a file into tool-call
arguments; none needs arithmetic. Each instance carries its reference solution (one tool call per
turn, ending with finish), from which gyre/harness/demos.py builds warm-start demonstrations.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from gyre.tasks.task import Task, task_id_for
from gyre.tasks.words import CONFIG_FILES, CONFIG_FLAGS, CONFIG_VALUES, CONFIG_VARS, FILE_STEMS, WORDS, WRITE_TARGETS

FamilySampler = Callable[[random.Random], Task]
FAMILIES: dict[str, FamilySampler] = {}
SLACK_TURNS = 2  # turns allowed beyond the reference solution


def register_family(name: str) -> Callable[[FamilySampler], FamilySampler]:
    def wrap(fn: FamilySampler) -> FamilySampler:
        FAMILIES[name] = fn
        return fn

    return wrap


def get_family(name: str) -> FamilySampler:
    if name not in FAMILIES:
        raise KeyError(f"unknown task family {name!r}; known families: {sorted(FAMILIES)} (config tasks.families)")
    return FAMILIES[name]


def _call(name: str, **arguments: object) -> dict:
    return {"name": name, "arguments": arguments}


def _make(family: str, prompt: str, files: dict[str, str], checks: list, visible: list, solution: list) -> Task:
    return Task(
        task_id=task_id_for(family, prompt, files),
        family=family,
        prompt=prompt,
        files=files,
        checks=checks,
        visible_checks=visible,
        max_turns=len(solution) + SLACK_TURNS,
        solution=solution,
    )


def write_value_task(path: str, word: str) -> Task:
    return _make(
        "write_value",
        f'Create "{path}" containing "{word}".',
        {},
        [
            {"name": f"{path} exists", "kind": "file_exists", "path": path},
            {"name": f"{path} == {word}", "kind": "file_equals", "path": path, "value": word},
        ],
        [{"name": f"{path} exists", "kind": "file_exists", "path": path}],
        [_call("write_file", path=path, content=word), _call("finish")],
    )


def echo_files_task(contents: dict[str, str]) -> Task:
    listing = ", ".join(f'"{path}" = "{value}"' for path, value in contents.items())
    return _make(
        "echo_files",
        f"Create files: {listing}.",
        {},
        [{"name": f"{p} == {v}", "kind": "file_equals", "path": p, "value": v} for p, v in contents.items()],
        [{"name": f"{p} exists", "kind": "file_exists", "path": p} for p in contents],
        [_call("write_file", path=p, content=v) for p, v in contents.items()] + [_call("finish")],
    )


def fix_value_task(path: str, assignments: dict[str, object], var: str, value: int) -> Task:
    lines = [f"{name} = {val}" for name, val in assignments.items()]
    fixed = [f"{name} = {value if name == var else val}" for name, val in assignments.items()]
    original, content = "\n".join(lines) + "\n", "\n".join(fixed) + "\n"
    return _make(
        "fix_value",
        f'In "{path}" set "{var}" to {value}.',
        {path: original},
        [  # the value check runs the file; doing nothing earns nothing
            {"name": f"{var} == {value}", "kind": "python_value", "path": path, "var": var, "value": value},
            {"name": "other lines unchanged", "kind": "lines_kept", "path": path, "var": var, "requires": f"{var} == {value}",
             "lines": [ln for ln, name in zip(lines, assignments, strict=True) if name != var]},
        ],  # fmt: skip
        [{"name": f"{path} runs", "kind": "python_runs", "path": path}],
        [_call("read_file", path=path), _call("write_file", path=path, content=content), _call("run_checks"),
         _call("finish")],
    )  # fmt: skip


@register_family("write_value")
def sample_write_value(rng: random.Random) -> Task:
    return write_value_task(rng.choice(WRITE_TARGETS), rng.choice(WORDS))


@register_family("echo_files")
def sample_echo_files(rng: random.Random) -> Task:
    n = rng.choices([1, 2, 3, 4, 5], weights=[30, 25, 20, 15, 10])[0]  # long tail of turns
    stems = rng.sample(FILE_STEMS, n)
    return echo_files_task({f"{stem}.txt": rng.choice(WORDS) for stem in stems})


@register_family("fix_value")
def sample_fix_value(rng: random.Random) -> Task:
    """2 or 3 lines: the whole file is copied into the rewrite, so it stays short."""
    var, *others = rng.sample(CONFIG_VARS, 3)
    others = others[: rng.choice([1, 1, 2])]
    if rng.random() < 0.5:
        others[-1] = rng.choice(CONFIG_FLAGS)
    names = [var, *others]
    rng.shuffle(names)
    assignments: dict[str, object] = {
        name: rng.choice([True, False]) if name in CONFIG_FLAGS else rng.choice(CONFIG_VALUES) for name in names
    }
    value = rng.choice([v for v in CONFIG_VALUES if v != assignments[var]])
    return fix_value_task(rng.choice(CONFIG_FILES), assignments, var, value)
