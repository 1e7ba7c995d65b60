"""SWE-bench instances in their own environments: an image per instance, built from an install spec per
repository/version in the shape of SWE-bench's own (MAP_REPO_VERSION_TO_SPECS), kept as data beside the
instances (`specs.json`, see examples/tasks/swebench_real).

SWE-bench makes an environment image (a Python, `packages`, `pip_packages`) and on it an instance image (the
repository at base_commit in /testbed, `pre_install`, `install`), then grades with `eval_commands` and
`test_cmd` plus the test files of test_patch. Here the same steps become one Dockerfile whose build context
holds the repository's files (`git archive` of the snapshot: binary files included) and the requirements
file SWE-bench would fetch, built by gyre/tasks/images.py like a Harbor task's: buildah, from a local base
(`base_image`, e.g. python:3.11-slim made by tools/make_base_images), once per distinct definition (the
environment's layers are shared by the instances of a repository/version: buildah --layers), pip reaching
PyPI at build time only. Rollouts and grading then run with that image as `/` under bwrap, offline, the
workspace mounted on the repository's directory, where the editable install (`pip install -e .`) points.

`packages` is pip's to install here (no conda): `requirements.txt` (the repository's requirement files at
environment_setup_commit, else base_commit, read from the snapshot as SWE-bench reads them from GitHub), or
package names; `environment.yml` is refused by name. SWE-bench runs `install` again before the tests; here
the tests are offline and the editable install already points at the workspace, so it is not rerun.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.sandbox.rootfs import cache_root
from gyre.tasks.task import TaskFormatError

SPECS_FILE = "specs.json"  # beside the instances' JSONL file
SPEC_KEYS = ("python", "packages", "pip_packages", "pre_install", "install", "test_cmd", "eval_commands",
             "base_image", "swebench_python")  # fmt: skip
NON_TEST_EXTS = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml", ".toml")
REQUIREMENTS_EXCLUDED = ("-e .", "#", ".[test")  # lines SWE-bench's get_requirements_by_commit drops
_TEST_PATCH_FILE = re.compile(r"diff --git a/.* b/(.*)")


@dataclass(frozen=True)
class InstallSpec:
    """One repository/version's environment, as SWE-bench specifies it (plus Gyre's `base_image`)."""

    python: str
    test_cmd: str
    install: str = ""
    packages: str = ""
    pip_packages: tuple[str, ...] = ()
    pre_install: tuple[str, ...] = ()
    eval_commands: tuple[str, ...] = ()
    base_image: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> InstallSpec:
        unknown = sorted(set(data) - set(SPEC_KEYS))
        if unknown:
            raise TaskFormatError(f"{where}: unknown keys {unknown}; an install spec has {list(SPEC_KEYS)}")
        for key in ("python", "test_cmd"):
            if not isinstance(data.get(key), str) or not data[key]:
                raise TaskFormatError(f"{where}: `{key}` must be a non-empty string")
        if data.get("packages") == "environment.yml":
            raise TaskFormatError(f"{where}: packages `environment.yml` (a conda environment) is not supported: "
                                  "list its packages in `pip_packages` instead")  # fmt: skip
        lists = {k: tuple(_strings(data.get(k, []), f"{where}: `{k}`")) for k in ("pip_packages", "pre_install",
                                                                                   "eval_commands")}  # fmt: skip
        return cls(python=data["python"], test_cmd=data["test_cmd"], install=str(data.get("install", "")),
                   packages=str(data.get("packages", "")), base_image=str(data.get("base_image", "")),
                   **lists)  # fmt: skip

    def base(self) -> str:
        """The image the environment starts from: `base_image`, else python:<python>-slim."""
        return self.base_image or f"python:{self.python}-slim"


def _strings(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TaskFormatError(f"{where} must be a list of strings")
    return value


@dataclass(frozen=True)
class Specs:
    """A specs.json: install specs by repository and version, the requirement files SWE-bench reads per
    repository (MAP_REPO_TO_REQS_PATHS), and what every environment gets besides (SWE-bench's base image:
    git and the like; the repository's directory)."""

    path: Path
    specs: dict[str, dict[str, InstallSpec]]
    requirements_paths: dict[str, list[str]] = field(default_factory=dict)
    apt_packages: tuple[str, ...] = ()
    repo_dir: str = "/testbed"

    def spec_for(self, repo: str, version: str) -> InstallSpec:
        if not version:
            raise TaskFormatError(f"the instance has no `version`: its install spec in {self.path} cannot be chosen")
        try:
            return self.specs[repo][version]
        except KeyError:
            known = sorted(self.specs.get(repo, {}))
            raise TaskFormatError(f"no install spec for {repo} version {version} in {self.path} "
                                  f"(it has {known or 'none for ' + repo})") from None  # fmt: skip


def load_specs(path: Path) -> Specs:
    """The install specs of `path` (TaskFormatError naming what is wrong)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TaskFormatError(f"cannot read install specs {path}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("specs"), dict):
        raise TaskFormatError(f"{path}: expected an object with `specs` (repository -> version -> spec)")
    specs = {
        repo: {version: InstallSpec.from_dict(spec, f"{path}: {repo} {version}") for version, spec in versions.items()}
        for repo, versions in data["specs"].items()
    }
    env = data.get("environment", {})
    return Specs(path, specs, {k: _strings(v, f"{path}: requirements_paths[{k!r}]")
                               for k, v in data.get("requirements_paths", {}).items()},
                 tuple(_strings(env.get("apt_packages", []), f"{path}: environment.apt_packages")),
                 str(env.get("repo_dir", "/testbed")))  # fmt: skip


def tested_files(test_patch: str) -> list[str]:
    """The files SWE-bench gives the test command: those test_patch touches, data files left out."""
    return [f for f in _TEST_PATCH_FILE.findall(test_patch) if not f.endswith(NON_TEST_EXTS)]


def spec_test_command(spec: InstallSpec, test_patch: str) -> list[str]:
    """The instance's tests as SWE-bench's eval script runs them: `eval_commands`, then `test_cmd` and the
    test files, in one shell."""
    command = " ".join([spec.test_cmd, *map(shlex.quote, tested_files(test_patch))])
    return ["bash", "-c", "\n".join([*spec.eval_commands, command])]


def requirements_text(read: Callable[[str], str | None], where: str, paths: list[str]) -> str:
    """The requirements SWE-bench installs for `packages: requirements.txt`: the first of `paths` that `read`
    finds, its `-r` files (beside it) first, then its own lines, without `-e .`, comments and `.[test]`."""
    for path in paths:
        text = read(path)
        if text is not None:
            break
    else:
        raise TaskFormatError(f"{where}: none of the requirement files {paths} is there")
    req_dir = path.rpartition("/")[0]
    kept = lambda line: not line.strip().startswith(REQUIREMENTS_EXCLUDED)  # noqa: E731
    included: list[str] = []
    own: list[str] = []
    for line in text.split("\n"):
        if line.strip().startswith("-r"):
            name = line.strip()[len("-r") :].strip()
            extra = read(f"{req_dir}/{name}" if req_dir else name)
            included += [ln for ln in (extra or "").split("\n") if kept(ln)]
        elif kept(line):
            own.append(line)
    return "\n".join([*included, "\n".join(own)])


def snapshot_reader(
    snapshot: Path, commit: str, base_commit: str, tree: dict[str, bytes]
) -> Callable[[str], str | None]:
    """Reads a file of the repository at `commit` from the snapshot (a git repository), or from the tree at
    base_commit when `commit` is base_commit (a plain-directory snapshot holds only that)."""

    def read(path: str) -> str | None:
        proc = subprocess.run(["git", "-c", "safe.directory=*", "-C", str(snapshot), "show", f"{commit}:{path}"],
                              capture_output=True)  # fmt: skip
        if proc.returncode == 0:
            return proc.stdout.decode()
        return tree[path].decode() if commit == base_commit and path in tree else None

    return read


def environment_dockerfile(spec: InstallSpec, specs: Specs, requirements: bool) -> str:
    """The Dockerfile of an instance's environment: SWE-bench's environment steps first (shared by a
    repository/version's instances through buildah's layer cache), then the repository and its install."""
    lines = [
        f"FROM {spec.base()}",
        "ARG PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore",
    ]
    if specs.apt_packages:
        lines.append("RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
                     f"{' '.join(map(shlex.quote, specs.apt_packages))} && rm -rf /var/lib/apt/lists/*")  # fmt: skip
    if requirements:
        lines += ["COPY requirements.txt /tmp/gyre-swebench/requirements.txt",
                  "RUN python -m pip install -r /tmp/gyre-swebench/requirements.txt && rm -rf /tmp/gyre-swebench"]  # fmt: skip
    elif spec.packages:
        lines.append(f"RUN python -m pip install {spec.packages}")
    if spec.pip_packages:
        lines.append(f"RUN python -m pip install {' '.join(map(shlex.quote, spec.pip_packages))}")
    lines += [f"COPY repo/ {specs.repo_dir}/", f"WORKDIR {specs.repo_dir}"]
    lines += [f"RUN {command}" for command in spec.pre_install]
    if spec.install:
        lines.append(f"RUN {spec.install}")
    return "\n".join(lines) + "\n"


def build_context(dockerfile: str, requirements: str | None, tree: dict[str, bytes], executables: list[str]) -> Path:
    """A build context directory holding the Dockerfile, the requirements and the repository under repo/, made
    once per content in the machine's cache ($GYRE_CACHE/swebench-contexts/<digest>)."""
    h = hashlib.sha256(b"gyre-swebench-context-v1\0" + dockerfile.encode() + b"\0" + (requirements or "").encode())
    for rel in sorted(tree):
        h.update(f"\0{rel}\0{rel in executables:d}\0{len(tree[rel])}\0".encode() + tree[rel])
    context = cache_root() / "swebench-contexts" / h.hexdigest()[:24]
    if (context / "Dockerfile").is_file():  # written last: a complete context
        return context
    context.parent.mkdir(parents=True, exist_ok=True)
    staging = context.with_name(f".{context.name}.{id(tree)}")
    for rel, data in tree.items():
        path = staging / "repo" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(0o755 if rel in executables else 0o644)
    if requirements is not None:
        (staging / "requirements.txt").write_text(requirements + "\n")
    (staging / "Dockerfile").write_text(dockerfile)
    try:
        staging.rename(context)
    except OSError:  # another loader made it first
        subprocess.run(["rm", "-rf", str(staging)], check=False)
    return context


def instance_environment(
    row: dict[str, Any], specs: Specs, snapshot: Path, tree: dict[str, bytes], executables: list[str]
) -> dict[str, Any]:
    """What the instance's Task gets to be built in its environment: dockerfile, build_context and the test
    command of its spec."""
    spec = specs.spec_for(row["repo"], str(row.get("version") or ""))
    requirements = None
    if spec.packages == "requirements.txt":
        paths = specs.requirements_paths.get(row["repo"])
        if not paths:
            raise TaskFormatError(f"{specs.path}: {row['repo']} installs `requirements.txt` but has no "
                                  "requirements_paths entry (SWE-bench's MAP_REPO_TO_REQS_PATHS)")  # fmt: skip
        commit = row.get("environment_setup_commit") or row["base_commit"]
        read = snapshot_reader(snapshot, commit, row["base_commit"], tree)
        requirements = requirements_text(read, f"{row['repo']}@{commit} in {snapshot}", paths)
    dockerfile = environment_dockerfile(spec, specs, requirements is not None)
    context = build_context(dockerfile, requirements, tree, executables)
    return {"dockerfile": str(context / "Dockerfile"), "build_context": str(context),
            "test_cmd": spec_test_command(spec, row["test_patch"])}  # fmt: skip
