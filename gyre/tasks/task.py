"""A task instance: prompt, initial workspace, and the checks that grade the workspace afterwards."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gyre.errors import UserError

# A check is a JSON object {"name": ..., "kind": ..., **params}; kinds live in gyre/tasks/checker.py.
CheckSpec = dict[str, Any]
# The initial workspace's files are text (str) or, for a file that is not UTF-8 (a PNG, a fixture), bytes
WorkspaceFile = str | bytes
MAX_WORKSPACE_BYTES = 256 << 20  # of one task's initial workspace: every rollout copies it


class TaskFormatError(UserError, ValueError):
    """A task on disk that Gyre cannot read; the message names the file and what to change."""


# What reading one task of a suite may raise besides TaskFormatError: a file that cannot be read, a value of
# the wrong type in task.toml or an instance row. Each skips that task (load_error says why), never the suite.
LOAD_ERRORS = (TaskFormatError, OSError, ValueError, KeyError, TypeError, AttributeError)


def load_error(e: BaseException) -> str:
    return str(e) if isinstance(e, TaskFormatError) else f"{type(e).__name__}: {e}"


@dataclass(frozen=True)
class SkippedTask:
    """A task of a suite on disk that cannot be used, and why (a run lists these; tools/check_tasks too)."""

    name: str  # the task directory's name, or the instance id (else `<jsonl>:<line>`)
    path: str
    cause: str

    def line(self) -> str:
        return f"{self.name}: skipped: {self.cause}"


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
    build context). `files` are text, or bytes where a file is not UTF-8 (MAX_WORKSPACE_BYTES in all).
    """

    task_id: str
    family: str
    prompt: str
    files: dict[str, WorkspaceFile] = field(default_factory=dict)
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
    directories: list[str] = field(default_factory=list)  # directories the workspace starts with that hold no file
    source: str = "builtin"
    source_path: str = ""
    build_context: str = ""
    dockerfile: str = ""
    # how the task's work splits between a main agent and sub-agents, for a harness that delegates (the built-in
    # one): {"prompt", "visible_checks", "solution", "max_turns"} of the main agent's share and "subtasks", a list
    # of the same for each sub-agent (gyre/tasks/families.py); empty: the task does not split
    delegation: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Task:
        return cls(**data)

    def harness_view(self) -> dict[str, Any]:
        """What a harness is told (the task file): never the hidden checks."""
        view = {"task_id": self.task_id, "prompt": self.prompt, "visible_checks": self.visible_checks}
        return view | ({"delegation": self.delegation} if self.delegation else {})

    def materialize(self, workspace: str | Path) -> Path:
        """Create the workspace directory with the task's initial files."""
        root = Path(workspace)
        root.mkdir(parents=True, exist_ok=True)
        for rel, content in self.files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content)
        for rel in self.executables:
            (root / rel).chmod(0o755)
        for rel in self.directories:
            (root / rel).mkdir(parents=True, exist_ok=True)
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


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


def check_workspace_size(files: dict[str, WorkspaceFile], where: str, limit: int | None = None) -> None:
    """Refuse (TaskFormatError, naming the largest files) an initial workspace over `limit` bytes (default
    MAX_WORKSPACE_BYTES): every rollout copies it, so a suite reports it rather than running out of disk."""
    limit = MAX_WORKSPACE_BYTES if limit is None else limit
    sizes = {rel: len(c.encode() if isinstance(c, str) else c) for rel, c in files.items()}
    total = sum(sizes.values())
    if total > limit:
        largest = ", ".join(f"{rel} ({_size(n)})" for rel, n in sorted(sizes.items(), key=lambda kv: -kv[1])[:3])
        raise TaskFormatError(
            f"{where}: the initial workspace is {_size(total)}, over the {_size(limit)} limit of a task's "
            f"workspace (largest: {largest}); leave large data out of the task or make it at test time"
        )


def as_text(files: dict[str, bytes]) -> dict[str, WorkspaceFile]:
    """Files as text where they are UTF-8, as bytes where not (a logo, a binary fixture)."""
    out: dict[str, WorkspaceFile] = {}
    for rel, data in files.items():
        try:
            out[rel] = data.decode()
        except UnicodeDecodeError:
            out[rel] = data
    return out


def task_id_for(family: str, prompt: str, files: dict[str, str]) -> str:
    """Content-derived id: the same instance always gets the same id."""
    digest = hashlib.sha1(json.dumps([family, prompt, files], sort_keys=True).encode()).hexdigest()
    return f"{family}-{digest[:10]}"
