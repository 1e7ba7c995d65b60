"""A task instance: prompt, initial workspace, and the checks that grade the workspace afterwards."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# A check is a JSON object {"name": ..., "kind": ..., **params}; kinds live in gyre/tasks/checker.py.
CheckSpec = dict[str, Any]


@dataclass(frozen=True)
class Task:
    """One instance of a task family.

    `checks` are hidden: only grading sees them. `visible_checks` are what the agent's run_checks
    tool reports. `solution` is a reference solution, one tool call {"name", "arguments"} per turn
    ending with finish (demonstrations are built from it; empty when unknown). `max_turns` is a
    hint: the solution's length plus some slack. `checker_source`, when set, replaces the built-in
    checker script (for a suite with its own test runner): it runs as `python -I checker.py
    spec.json` and must print `{"results": [{"name", "passed", "detail"}, ...]}` as its last line.
    """

    task_id: str
    family: str
    prompt: str
    files: dict[str, str] = field(default_factory=dict)
    checks: list[CheckSpec] = field(default_factory=list)
    visible_checks: list[CheckSpec] = field(default_factory=list)
    max_turns: int = 10
    solution: list[dict[str, Any]] = field(default_factory=list)
    checker_source: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Task:
        return cls(**data)

    def harness_view(self) -> dict[str, Any]:
        """What a harness is told (the task file): never the hidden checks."""
        return {"task_id": self.task_id, "prompt": self.prompt, "visible_checks": self.visible_checks}

    def materialize(self, workspace: str | Path) -> Path:
        """Create the workspace directory with the task's initial files."""
        root = Path(workspace)
        root.mkdir(parents=True, exist_ok=True)
        for rel, content in self.files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
        return root


def task_id_for(family: str, prompt: str, files: dict[str, str]) -> str:
    """Content-derived id: the same instance always gets the same id."""
    digest = hashlib.sha1(json.dumps([family, prompt, files], sort_keys=True).encode()).hexdigest()
    return f"{family}-{digest[:10]}"
