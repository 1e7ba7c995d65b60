"""A task instance: prompt, initial workspace, and the checks that grade the workspace afterwards."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
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
    spec.json` and must print `{"results": [{"name", "passed", "detail"}, ...]}` as its last line
    (optionally with `"score"`: the reward, when it is not the fraction of results passed).

    Tasks from a suite on disk (gyre/tasks/source.py) also set: `checker`, the gyre checker that
    grades them (builtin, harbor, swebench: gyre/tasks/checker.py, harbor_checker.py,
    swebench_checker.py); `grading`, what that checker is told besides the checks (test commands, patches, test ids); `hidden_files`, files (relative path ->
    base64) that exist only in the grading sandbox, read-only at /tests (Harbor's tests/); `workdir`,
    a second path of the workspace in the sandbox (a Harbor image's WORKDIR, e.g. /app); `image`, the
    environment image (sandbox.apptainer_images maps it to a .sif); `agent_timeout_s` and
    `check_timeout_s`, the task's own limits (the harness gets the shorter of its own and the task's);
    `init_git`, make the workspace a git repository with one commit (a SWE-bench repo at its base
    commit); `source` and `source_path`, where the task came from (shard provenance); `build_context` and
    `dockerfile`, what its environment is built from (a Harbor task's environment/, or its compose file's
    build context).
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
    checker: str = "builtin"
    grading: dict[str, Any] = field(default_factory=dict)
    hidden_files: dict[str, str] = field(default_factory=dict)
    workdir: str = ""
    image: str = ""
    agent_timeout_s: float | None = None
    check_timeout_s: float | None = None
    init_git: bool = False
    executables: list[str] = field(default_factory=list)  # files of `files` with the executable bit
    source: str = "builtin"
    source_path: str = ""
    build_context: str = ""
    dockerfile: str = ""

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
        for rel in self.executables:
            (root / rel).chmod(0o755)
        if self.init_git:
            commit_tree(root)
        return root


# A fixed identity and date: the same tree always gives the same commit (a snapshot's base_commit)
GIT_ENV = {
    "GIT_AUTHOR_NAME": "gyre", "GIT_AUTHOR_EMAIL": "gyre@localhost", "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_NAME": "gyre", "GIT_COMMITTER_EMAIL": "gyre@localhost",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",
}  # fmt: skip


def commit_tree(root: Path, message: str = "base") -> str:
    """`git init` + one commit of everything under `root` with GIT_ENV; returns the commit id."""
    env = {**os.environ, **GIT_ENV}

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, env=env, check=True, capture_output=True, text=True).stdout

    git("init", "-q", "-b", "main")
    git("add", "-A")
    git("commit", "-q", "--allow-empty", "-m", message)
    return git("rev-parse", "HEAD").strip()


def task_id_for(family: str, prompt: str, files: dict[str, str]) -> str:
    """Content-derived id: the same instance always gets the same id."""
    digest = hashlib.sha1(json.dumps([family, prompt, files], sort_keys=True).encode()).hexdigest()
    return f"{family}-{digest[:10]}"
