"""SWE-bench-style instances as Gyre tasks: a JSONL file of the `swebench` package's instance fields plus
local repository snapshots (nothing is cloned at run time).

Fields read: instance_id, repo, base_commit, problem_statement (the prompt), test_patch, patch (the
reference fix: tools/check_tasks.py applies it), FAIL_TO_PASS, PASS_TO_PASS (lists, or JSON text of lists
as in the published datasets), and optionally image (the environment image for sandbox.apptainer_images),
and Gyre's own agent_timeout_s (the instance's limit for the agent), test_cmd (argv list or shell string;
default: the test files of test_patch under `python3 -m unittest -v`, or `python3 -m pytest -rA` with
log_parser pytest) and log_parser (unittest | pytest).

With tasks.build_images (tools/check_tasks --build-images), each instance is built into the environment
its install spec defines (`<jsonl dir>/specs.json`, chosen by repo and `version`; environment_setup_commit,
else base_commit, for its requirement files; gyre/tasks/swebench_images.py), and its tests are the spec's
test_cmd on the test files of test_patch, run in that image; without, they run on the sandbox's /usr with
the instance's test_cmd.

The snapshot of `owner/name` is `<repos>/owner__name`: a git repository holding base_commit, or a plain
directory that is the tree at base_commit (Gyre commits it with a fixed identity and date, and the
commit id must equal base_commit: `python -m tools.check_tasks --commit-id DIR` prints it).
Each instance's source_path is `<jsonl>:<line>`: the reference `patch` is read from there, never sent along.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from gyre.tasks.swebench_images import SPECS_FILE, Specs, instance_environment, load_specs
from gyre.tasks.task import (
    LOAD_ERRORS,
    SkippedTask,
    Task,
    TaskFormatError,
    as_text,
    check_workspace_size,
    commit_tree,
    load_error,
)

REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS")
LOG_PARSERS = ("unittest", "pytest")
_DIFF_PATH = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)


def _tests(row: dict[str, Any], key: str) -> list[str]:
    value = row[key]
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise TaskFormatError(f"instance {row['instance_id']}: {key} must be a list of test ids")
    return value


def patch_paths(patch: str) -> list[str]:
    """Files a git diff touches (both sides of a rename), in order."""
    paths: list[str] = []
    for a, b in _DIFF_PATH.findall(patch):
        for p in (a, b):
            if p not in paths:
                if p.startswith("/") or ".." in Path(p).parts:
                    raise TaskFormatError(f"patch path {p!r} leaves the repository")
                paths.append(p)
    return paths


def snapshot_files(snapshot: Path, base_commit: str) -> tuple[dict[str, bytes], list[str]]:
    """(the tree at base_commit, its executable files): from a git repository (`git archive`), or a plain
    directory checked against it."""
    if not snapshot.is_dir():
        raise TaskFormatError(f"no repository snapshot at {snapshot}")
    git = ["git", "-c", "safe.directory=*", "-C", str(snapshot)]
    is_repo = (snapshot / ".git").exists() or (snapshot / "HEAD").is_file() and (snapshot / "objects").is_dir()
    if is_repo:
        proc = subprocess.run([*git, "archive", "--format=tar", base_commit], capture_output=True)
        if proc.returncode != 0:
            raise TaskFormatError(f"{snapshot}: cannot read base_commit {base_commit}: {proc.stderr.decode().strip()}")
        with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
            members = [m for m in tar.getmembers() if m.isfile()]
            files = {m.name: tar.extractfile(m).read() for m in members}  # type: ignore[union-attr]
            return files, sorted(m.name for m in members if m.mode & 0o111)
    files, executables = plain_snapshot(snapshot), plain_executables(snapshot)
    commit = snapshot_commit(files, executables)
    if commit != base_commit:
        raise TaskFormatError(f"snapshot {snapshot} is commit {commit}, not the instance's base_commit {base_commit}")
    return files, executables


def plain_snapshot(snapshot: Path) -> dict[str, bytes]:
    """The files of a plain-directory snapshot (Python's __pycache__ left out: running code there adds it)."""
    return {
        p.relative_to(snapshot).as_posix(): p.read_bytes()
        for p in sorted(snapshot.rglob("*"))
        if p.is_file() and "__pycache__" not in p.relative_to(snapshot).parts
    }


def plain_executables(snapshot: Path) -> list[str]:
    return sorted(rel for rel in plain_snapshot(snapshot) if os.access(snapshot / rel, os.X_OK))


def snapshot_commit(files: dict[str, bytes], executables: list[str] | tuple[str, ...] = ()) -> str:
    """The commit id of `files` as one commit of gyre's fixed identity and date (Task.init_git makes the same)."""
    with tempfile.TemporaryDirectory() as tmp:
        for rel, data in files.items():
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / rel).write_bytes(data)
        for rel in executables:
            (Path(tmp) / rel).chmod(0o755)
        return commit_tree(Path(tmp))


def default_test_cmd(test_files: list[str], log_parser: str) -> list[str]:
    """SWE-bench runs the test files its test patch touches."""
    files = [f for f in test_files if f.endswith(".py")]
    if log_parser == "pytest":
        return ["python3", "-m", "pytest", "-rA", *files]
    return ["python3", "-m", "unittest", "-v", *(f[:-3].replace("/", ".") for f in files)]


def instance_task(
    row: dict[str, Any],
    repos: Path,
    cache: dict[tuple[str, str], tuple[dict[str, bytes], list[str]]],
    specs: Specs | None = None,
) -> Task:
    """The instance as a Task; with `specs`, to be built in the environment its install spec defines
    (gyre/tasks/swebench_images.py: dockerfile and build_context set, the spec's test command)."""
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise TaskFormatError(f"instance {row.get('instance_id', '?')}: missing fields {missing}")
    snapshot = repos / row["repo"].replace("/", "__")
    key = (row["repo"], row["base_commit"])
    if key not in cache:
        cache[key] = snapshot_files(snapshot, row["base_commit"])
    tree, executables = cache[key]
    environment = instance_environment(row, specs, snapshot, tree, executables) if specs is not None else {}
    files = as_text(tree)  # a logo or a binary fixture stays bytes
    check_workspace_size(files, f"{row['repo']}@{row['base_commit']}")
    log_parser = row.get("log_parser", "unittest")
    if log_parser not in LOG_PARSERS:
        raise TaskFormatError(f"instance {row['instance_id']}: log_parser {log_parser!r}; choose one of {LOG_PARSERS}")
    touched = patch_paths(row["test_patch"])
    test_cmd = environment.get("test_cmd") or row.get("test_cmd") or default_test_cmd(touched, log_parser)
    grading = {
        "test_patch": row["test_patch"],
        "reset_files": {p: base64.b64encode(tree[p]).decode() if p in tree else None for p in touched},
        "test_cmd": test_cmd if isinstance(test_cmd, list) else ["bash", "-c", test_cmd],
        "log_parser": log_parser,
        "FAIL_TO_PASS": _tests(row, "FAIL_TO_PASS"),
        "PASS_TO_PASS": _tests(row, "PASS_TO_PASS"),
    }
    return Task(
        task_id=row["instance_id"],
        family="swebench",
        prompt=row["problem_statement"].strip(),
        files=files,
        max_turns=50,
        checker="swebench",
        grading=grading,
        image=row.get("image", ""),
        agent_timeout_s=float(row["agent_timeout_s"]) if row.get("agent_timeout_s") is not None else None,
        init_git=True,
        executables=executables,
        source="swebench",
        source_path=row["_source_path"],
        dockerfile=environment.get("dockerfile", ""),
        build_context=environment.get("build_context", ""),
    )


def _json_line(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise TaskFormatError(f"not JSON: {e}") from None


def load_swebench_tasks(jsonl: Path, repos: Path | None = None, build_images: bool = False) -> list[Task]:
    """Every instance of `jsonl` (one JSON object a line), snapshots under `repos` (default: <jsonl dir>/repos);
    the first that cannot be read raises (load_swebench_suite skips it instead)."""
    tasks, skipped = load_swebench_suite(jsonl, repos, build_images)
    if skipped:
        raise TaskFormatError(f"{skipped[0].path}: {skipped[0].cause}")
    return tasks


def load_swebench_suite(
    jsonl: Path, repos: Path | None = None, build_images: bool = False
) -> tuple[list[Task], list[SkippedTask]]:
    """The instances of `jsonl` that load, and each one that does not with its cause (a repeated instance id
    keeps its first line). With `build_images`, each is to be built in the environment of its install spec
    (<jsonl dir>/specs.json; gyre/tasks/swebench_images.py); without, its tests run on the sandbox's /usr."""
    if not jsonl.is_file():
        raise TaskFormatError(f"tasks.path={str(jsonl)!r} is not a JSONL file of SWE-bench instances")
    repos = repos or jsonl.parent / "repos"
    specs = load_specs(jsonl.parent / SPECS_FILE) if build_images else None
    cache: dict[tuple[str, str], tuple[dict[str, bytes], list[str]]] = {}
    tasks: list[Task] = []
    skipped: list[SkippedTask] = []
    first_line: dict[str, int] = {}
    for n, line in enumerate(jsonl.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where, name = f"{jsonl.resolve()}:{n}", f"{jsonl.name}:{n}"
        try:
            row = _json_line(line)
            if not isinstance(row, dict):
                raise TaskFormatError("not a JSON object")
            name = str(row.get("instance_id") or name)
            if name in first_line:
                raise TaskFormatError(f"instance id {name} repeats line {first_line[name]}")
            first_line[name] = n
            tasks.append(instance_task({**row, "_source_path": where}, repos, cache, specs))
        except LOAD_ERRORS as e:
            skipped.append(SkippedTask(name, where, load_error(e)))
    return tasks, skipped
