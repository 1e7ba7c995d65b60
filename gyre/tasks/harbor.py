"""Harbor / Terminal-Bench 2 task directories as Gyre tasks (the format of the `harbor` package's TaskPaths).

    <task>/instruction.md        the prompt
    <task>/task.toml             [agent] timeout_sec, [verifier] timeout_sec and env, [environment] docker_image
                                 (else the directory name: the image name) and workdir, [metadata] max_turns;
                                 cpus/memory_mb are not enforced (the sandbox's rlimits apply)
    <task>/environment/Dockerfile  WORKDIR is the working directory; its COPY/ADD of build-context files
                                 into the working directory make the initial workspace (RUN steps are the
                                 image's: apptainer runs the converted image, bwrap the host's /usr); files
                                 that are not UTF-8 are kept as bytes
    docker-compose.yaml          (in environment/ or the task root) its service's `build` context and
                                 Dockerfile replace environment/ (recorded as Task.build_context/dockerfile)
    <task>/tests/test.sh         the verifier: writes /logs/verifier/reward.txt or reward.json
    <task>/solution/solve.sh     the reference solution (tools/check_tasks.py runs it)

tests/ reaches the grading sandbox only (gyre/tasks/grading.py); the agent never sees it.
A suite loads task by task: one that cannot be read is skipped with its cause (load_harbor_suite), and
multi-step tasks ([[steps]] in task.toml, no instruction.md) are named as unsupported, never passed over.
"""

from __future__ import annotations

import base64
import os
import posixpath
import shlex
import tomllib
from pathlib import Path
from typing import Any

import yaml

from gyre.tasks.task import (
    LOAD_ERRORS,
    SkippedTask,
    Task,
    TaskFormatError,
    WorkspaceFile,
    as_text,
    check_workspace_size,
    load_error,
)

__all__ = ["TaskFormatError", "load_harbor_suite", "load_harbor_task", "load_harbor_tasks", "workspace_from_dockerfile"]

DEFAULT_VERIFIER_TIMEOUT_S = 600.0  # harbor's VerifierConfig.timeout_sec
COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")


def is_harbor_task(path: Path) -> bool:
    """A directory with task.toml: a task (one without instruction.md is reported, as multi-step or incomplete)."""
    return (path / "task.toml").is_file()


def harbor_task_dirs(root: Path) -> list[Path]:
    """`root` itself when it is a task, else its task subdirectories (sorted by name)."""
    if is_harbor_task(root):
        return [root]
    if not root.is_dir():
        raise TaskFormatError(f"tasks.path={str(root)!r} is not a directory of Harbor tasks")
    dirs = sorted(p for p in root.iterdir() if p.is_dir() and is_harbor_task(p))
    if not dirs:
        raise TaskFormatError(
            f"tasks.path={str(root)!r} holds no Harbor task (a directory with task.toml and instruction.md)"
        )
    return dirs


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise TaskFormatError(f"{path} is not UTF-8 text") from None


def _file(path: Path) -> WorkspaceFile:
    return as_text({"": path.read_bytes()})[""]


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _dockerfile_lines(text: str) -> list[list[str]]:
    """Instructions as word lists, continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in text.splitlines():
        if not current and line.strip().startswith("#"):
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip():
            out.append(shlex.split(current, comments=False))
        current = ""
    return out


def workspace_from_dockerfile(
    env_dir: Path, workdir_override: str = "", context: Path | None = None, dockerfile: Path | None = None
) -> tuple[str, dict[str, WorkspaceFile], list[str]]:
    """(working directory, files relative to it, the executable ones) from environment/Dockerfile's WORKDIR
    and COPY/ADD lines; COPY sources are read from `context` (default: environment/ itself)."""
    dockerfile = dockerfile or env_dir / "Dockerfile"
    context = context or env_dir
    if not dockerfile.is_file():
        return workdir_override, {}, []
    steps, workdir = _dockerfile_lines(dockerfile.read_text()), "/"
    for words in steps:
        if words and words[0].upper() == "WORKDIR":
            workdir = posixpath.normpath(posixpath.join(workdir, words[1]))
    final = workdir_override or (workdir if workdir != "/" else "")
    files: dict[str, WorkspaceFile] = {}
    executables: list[str] = []
    workdir = "/"
    for words in steps:
        op = words[0].upper() if words else ""
        if op == "WORKDIR":
            workdir = posixpath.normpath(posixpath.join(workdir, words[1]))
        if op not in ("COPY", "ADD"):
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if any(w.startswith("--from") for w in words[1:]):
            raise TaskFormatError(f"{dockerfile}: `{' '.join(words)}` copies from another stage; not supported")
        *sources, dest = args
        dest_abs = posixpath.normpath(posixpath.join(workdir, dest))
        if not final or not (dest_abs == final or dest_abs.startswith(final.rstrip("/") + "/")):
            raise TaskFormatError(
                f"{dockerfile}: `{' '.join(words)}` copies to {dest_abs}, outside the working directory "
                f"{final or '(no WORKDIR)'}; Gyre's workspace is the working directory only: copy into it"
            )
        into_dir = dest.endswith("/") or len(sources) > 1
        for src in sources:
            src_path = (context / src).resolve()
            if not src_path.is_relative_to(context.resolve()) or not src_path.exists():
                where = "environment/" if context == env_dir else f"the build context {context}"
                raise TaskFormatError(f"{dockerfile}: COPY source {src!r} is not in {where}")
            base = posixpath.relpath(dest_abs, final)
            if src_path.is_dir():
                pairs = [(f, posixpath.join(base, f.relative_to(src_path).as_posix()))
                         for f in sorted(p for p in src_path.rglob("*") if p.is_file())]  # fmt: skip
            else:
                pairs = [(src_path, posixpath.join(base, src_path.name) if into_dir else base)]
            for f, rel in pairs:
                files[posixpath.normpath(rel)] = _file(f)
                if os.access(f, os.X_OK):
                    executables.append(posixpath.normpath(rel))
    return final, files, sorted(set(executables) & set(files))


AGENT_SERVICES = ("main", "client")  # the agent's container: Harbor's `main`, Terminal-Bench 1's `client`


def compose_build(task_dir: Path) -> tuple[Path, Path] | None:
    """(build context, Dockerfile) of the agent's own container in the task's compose file, if the compose file
    says how to build it: Terminal-Bench-style tasks build from the task root, not environment/. The agent's
    service is `main` (Harbor) or `client` (Terminal-Bench 1); other services with a build are sidecars (an API
    server, a simulated user) that Gyre does not run, never the agent's environment. None (environment/Dockerfile)
    when the agent's service has no build of its own (Harbor builds `main` from environment/), or when only
    sidecars build and environment/Dockerfile exists."""
    for base in (task_dir / "environment", task_dir):
        for name in COMPOSE_FILES:
            if (base / name).is_file():
                return _compose_build(base / name, task_dir)
    return None


def _compose_build(path: Path, task_dir: Path) -> tuple[Path, Path] | None:
    try:
        compose = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise TaskFormatError(f"{path}: not YAML: {e}") from None
    services = compose.get("services") if isinstance(compose, dict) else None
    services = services if isinstance(services, dict) else {}
    agent = [n for n in AGENT_SERVICES if n in services]
    if not agent and (task_dir / "environment" / "Dockerfile").is_file():
        return None
    for name in agent or list(services):
        service = services[name]
        build = service.get("build") if isinstance(service, dict) else None
        build = {"context": build} if isinstance(build, str) else build
        if isinstance(build, dict):
            context = (path.parent / str(build.get("context", "."))).resolve()
            if not context.is_relative_to(task_dir.resolve()):
                raise TaskFormatError(f"{path}: build context {context} is outside the task directory")
            return context, context / str(build.get("dockerfile", "Dockerfile"))
        if agent:
            return None
    return None


def load_harbor_task(task_dir: Path, build_images: bool = False) -> Task:
    """With `build_images`, the workspace comes from the built image (gyre/tasks/images.py fills it in), so the
    Dockerfile's COPY lines are not read here."""
    task_dir = task_dir.resolve()
    try:
        config: dict[str, Any] = tomllib.loads((task_dir / "task.toml").read_text())
    except tomllib.TOMLDecodeError as e:
        raise TaskFormatError(f"{task_dir / 'task.toml'}: {e}") from None
    if config.get("steps"):
        raise TaskFormatError(
            f"multi-step Harbor task ({len(config['steps'])} [[steps]] in task.toml): unsupported; Gyre runs "
            "single-instruction tasks (instruction.md)"
        )
    if not (task_dir / "instruction.md").is_file():
        raise TaskFormatError(f"{task_dir}: no instruction.md (the task's prompt)")
    agent, verifier, env = config.get("agent", {}), config.get("verifier", {}), config.get("environment", {})
    tests = task_dir / "tests"
    if not (tests / "test.sh").is_file():
        raise TaskFormatError(f"{task_dir}: no tests/test.sh (the verifier that writes /logs/verifier/reward.txt)")
    env_dir = task_dir / "environment"
    context, dockerfile = compose_build(task_dir) or (env_dir, env_dir / "Dockerfile")
    if build_images:
        workdir, files, executables = env.get("workdir") or "", {}, []
    else:
        workdir, files, executables = workspace_from_dockerfile(env_dir, env.get("workdir") or "", context, dockerfile)
        check_workspace_size(files, str(task_dir))
    hidden = {p.relative_to(tests).as_posix(): _b64(p) for p in sorted(tests.rglob("*")) if p.is_file()}
    return Task(
        task_id=task_dir.name,
        family="harbor",
        prompt=_text(task_dir / "instruction.md").strip(),
        files=files,
        executables=executables,
        max_turns=int(config.get("metadata", {}).get("max_turns", 50)),
        checker="harbor",
        grading={"test_script": "test.sh", "env": {str(k): str(v) for k, v in verifier.get("env", {}).items()}},
        hidden_files=hidden,
        workdir=workdir,
        image=env.get("docker_image") or task_dir.name,
        agent_timeout_s=float(agent["timeout_sec"]) if agent.get("timeout_sec") is not None else None,
        check_timeout_s=float(verifier.get("timeout_sec", DEFAULT_VERIFIER_TIMEOUT_S)),
        source="harbor",
        source_path=str(task_dir),
        build_context=str(context),
        dockerfile=str(dockerfile) if dockerfile.is_file() else "",
    )


def load_harbor_tasks(root: Path, build_images: bool = False) -> list[Task]:
    """Every task of `root`; the first that cannot be read raises (load_harbor_suite skips it instead)."""
    return [load_harbor_task(d, build_images) for d in harbor_task_dirs(root)]


def load_harbor_suite(root: Path, build_images: bool = False) -> tuple[list[Task], list[SkippedTask]]:
    """The tasks of `root` that load, and each one that does not with its cause: one bad task never stops a suite."""
    tasks, skipped = [], []
    for task_dir in harbor_task_dirs(root):
        try:
            tasks.append(load_harbor_task(task_dir, build_images))
        except LOAD_ERRORS as e:
            skipped.append(SkippedTask(task_dir.name, str(task_dir), load_error(e)))
    return tasks, skipped
