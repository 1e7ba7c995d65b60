"""Environment images: a task's own Dockerfile built by buildah, once per distinct definition, unpacked once.

A Harbor task's environment is `environment/Dockerfile` (or the build context of its docker-compose.yaml).
buildah (Debian's, rootful, `--isolation chroot`) builds it, so FROM, RUN, COPY, ADD, WORKDIR, ENV and USER
mean what Docker means by them; RUN steps run here, on the build host, where the network is. The image is
named by a digest of the Dockerfile and every file of its context, so a definition is built once per
machine and reused across rollouts and runs (`$GYRE_CACHE/images/<digest>`, gyre/sandbox/rootfs.py), and
unpacked once into a read-only root filesystem that bwrap runs rollouts and grading in.

Base images named by FROM never come from a registry (none is reachable from compute nodes): they are
imported from a local store of OCI archives (`<name>_<tag>.tar`, e.g. python_3.11-slim.tar) or OCI layout
directories the user fills (`tasks.images`), or made here by `python -m tools.make_base_images`.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.fsutil import locked
from gyre.sandbox.rootfs import IMAGE_PREFIX, ImageRoot, cache_root, image_root, images_dir, passwd_ids
from gyre.tasks import offline_tests
from gyre.tasks.task import Task, TaskFormatError, WorkspaceFile, as_text, check_workspace_size

MAKE_BASES = "python -m tools.make_base_images"


class ImageBuildError(TaskFormatError):
    """A task's environment cannot be built; the message names the task's file and the builder's output."""


class BaseImageMissing(ImageBuildError):
    """A base named by FROM is in neither the builder's storage nor the local store."""


@dataclass(frozen=True)
class BuildSpec:
    """What an environment is built from: a Dockerfile and its build context directory."""

    dockerfile: Path
    context: Path

    def digest(self) -> str:
        """sha256 of the Dockerfile and of every context file (path, executable bit, bytes or link target)."""
        h = hashlib.sha256(b"gyre-env-v1\0" + self.dockerfile.read_bytes() + b"\0")
        for path in sorted(self.context.rglob("*")):
            rel = path.relative_to(self.context).as_posix()
            if path.is_symlink():
                h.update(f"L {rel} {os.readlink(path)}\0".encode())
            elif path.is_file():
                h.update(f"F {rel} {os.access(path, os.X_OK):d} {path.stat().st_size}\0".encode())
                h.update(path.read_bytes())
        return h.hexdigest()[:24]


def base_images(dockerfile: str) -> list[str]:
    """The images a Dockerfile's FROM lines name, its own stage names left out."""
    bases: list[str] = []
    stages: set[str] = set()
    for line in dockerfile.splitlines():
        words = line.split()
        if not words or words[0].upper() != "FROM":
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if args and args[0] not in stages and args[0] != "scratch":
            bases.append(args[0])
        if len(args) >= 3 and args[1].upper() == "AS":
            stages.add(args[2])
    return bases


def qualified(name: str) -> str:
    """Docker's full name of a short image name: debian:bookworm -> docker.io/library/debian:bookworm."""
    first, _, rest = name.partition("/")
    if not rest or ("." not in first and ":" not in first and first != "localhost"):
        name = f"docker.io/{name if rest else 'library/' + name}"
    last = name.rsplit("/", 1)[-1]
    return name if ":" in last or "@" in last else f"{name}:latest"


def archive_stem(name: str) -> str:
    """The file name (without .tar) a base image has in a local store: python:3.11-slim -> python_3.11-slim."""
    short = name.removeprefix("docker.io/").removeprefix("library/")
    return short.replace("/", "_").replace(":", "_")


@dataclass
class ImageBuilder:
    """buildah with its own storage under the machine's cache, and the local stores bases come from."""

    stores: list[Path] = field(default_factory=list)  # tasks.images, then $GYRE_CACHE/bases
    cache: Path = field(default_factory=images_dir)
    buildah: str = "buildah"

    def __post_init__(self) -> None:
        self.stores = [*self.stores, cache_root() / "bases"]

    def run(self, *args: str, timeout: float = 3600.0) -> subprocess.CompletedProcess[str]:
        """buildah on this builder's storage (needed only to build: a cached image is used without it)."""
        if shutil.which(self.buildah) is None:
            raise ImageBuildError(
                f"`{self.buildah}` is not on PATH: install buildah (apt-get install buildah mmdebstrap, or run "
                "tools/setup_env.sh) to build task environments, or point $GYRE_CACHE at a cache they were built in"
            )
        storage = ["--root", str(self.cache / "storage"), "--runroot", str(self.cache / "run")]
        return subprocess.run([self.buildah, *storage, *args], capture_output=True, text=True, timeout=timeout)

    def has_image(self, name: str) -> bool:
        return self.run("inspect", "--type", "image", name).returncode == 0

    def ensure_base(self, name: str) -> None:
        """Import the base `name` from a local store unless the builder has it; BaseImageMissing says how."""
        full = qualified(name)
        if self.has_image(full):
            return
        for store in self.stores:
            for path, transport in ((store / f"{archive_stem(name)}.tar", "oci-archive"),
                                    (store / archive_stem(name), "oci")):  # fmt: skip
                if path.exists():
                    self.import_base(f"{transport}:{path}", full)
                    return
        raise BaseImageMissing(
            f"base image {name!r} (FROM) is not available: no registry is used, so put it in a local store as "
            f"an OCI archive {archive_stem(name)}.tar or OCI layout directory {archive_stem(name)}/ in one of "
            f"{[str(s) for s in self.stores]} (tasks.images names your own store; e.g. `skopeo copy "
            f"docker://{name} oci-archive:{archive_stem(name)}.tar` where a registry is reachable), or make the "
            f"common bases here with `{MAKE_BASES}` (debian:bookworm, python:3.11-slim; `--stand-in {name}=debian:bookworm` "
            "runs the task on Debian instead)"
        )

    def import_base(self, source: str, full_name: str) -> None:
        pulled = self.run("pull", "--quiet", source)
        if pulled.returncode != 0:
            raise ImageBuildError(f"cannot import base image {source}: {pulled.stderr.strip()[-500:]}")
        tagged = self.run("tag", pulled.stdout.strip().splitlines()[-1], full_name)
        if tagged.returncode != 0:
            raise ImageBuildError(f"cannot name {source} {full_name}: {tagged.stderr.strip()}")

    def build(self, spec: BuildSpec, timeout: float = 3600.0) -> str:
        """The image name (gyre-env:<digest>) of `spec`, built and unpacked unless this machine has it."""
        digest = spec.digest()
        out = self.cache / digest
        if (out / "image.json").is_file():
            return IMAGE_PREFIX + digest
        self.cache.mkdir(parents=True, exist_ok=True)
        with locked(self.cache / f"{digest}.lock"):
            if not (out / "image.json").is_file():
                self._build_and_unpack(spec, digest, out, timeout)
        return IMAGE_PREFIX + digest

    def _build_and_unpack(self, spec: BuildSpec, digest: str, out: Path, timeout: float) -> None:
        started = time.monotonic()
        for base in base_images(spec.dockerfile.read_text()):
            self.ensure_base(base)
        tag = IMAGE_PREFIX + digest
        with tempfile.TemporaryDirectory(prefix="gyre-bud-") as scratch:
            dockerfile, trust = build_host_trust(spec.dockerfile, Path(scratch))
            proc = self.run("bud", "--isolation", "chroot", "--pull=never", "--layers", "--quiet", *trust, "-f",
                            str(dockerfile), "-t", tag, str(spec.context), timeout=timeout)  # fmt: skip
        if proc.returncode != 0:
            lines = (proc.stdout + proc.stderr).strip().splitlines()
            error = build_error(lines)
            tail = [line for line in lines[-15:] if line.strip() != error]  # the error once, first
            raise ImageBuildError(f"{spec.dockerfile}: buildah bud failed (exit {proc.returncode}): {error}\n"
                                  + "\n".join(tail))  # fmt: skip
        built_s = time.monotonic() - started
        staging = Path(tempfile.mkdtemp(prefix=f".{digest}-", dir=self.cache))
        try:
            self._unpack(tag, staging / "rootfs")
            meta = self._runtime_config(tag, staging / "rootfs")
            meta.update(dockerfile=str(spec.dockerfile), built_s=round(built_s, 2),
                        unpacked_s=round(time.monotonic() - started - built_s, 2))  # fmt: skip
            (staging / "image.json").write_text(json.dumps(meta, indent=1))
            staging.rename(out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _unpack(self, image: str, rootfs: Path) -> None:
        """Copy the image's files into `rootfs` (buildah from + mount: no compression round trip)."""
        made = self.run("from", "--pull=never", "--quiet", image)
        if made.returncode != 0:
            raise ImageBuildError(f"buildah from {image}: {made.stderr.strip()}")
        container = made.stdout.strip().splitlines()[-1]
        try:
            mounted = self.run("mount", container)
            if mounted.returncode != 0:
                raise ImageBuildError(f"buildah mount {image}: {mounted.stderr.strip()}")
            rootfs.mkdir()
            cp = subprocess.run(
                ["cp", "-a", f"{mounted.stdout.strip()}/.", str(rootfs)], capture_output=True, text=True
            )
            if cp.returncode != 0:
                raise ImageBuildError(f"unpacking {image}: {cp.stderr.strip()[-500:]}")
        finally:
            self.run("umount", container)
            self.run("rm", container)

    def _runtime_config(self, image: str, rootfs: Path) -> dict[str, Any]:
        """ENV, WORKDIR and USER (resolved to ids in the image's /etc/passwd) of the built image."""
        proc = self.run("inspect", "--type", "image", image)
        if proc.returncode != 0:
            raise ImageBuildError(f"buildah inspect {image}: {proc.stderr.strip()}")
        config = json.loads(proc.stdout).get("OCIv1", {}).get("config", {})
        env = dict(item.split("=", 1) for item in config.get("Env") or [] if "=" in item)
        user = config.get("User") or ""
        try:
            uid, gid = passwd_ids(rootfs, user)
        except (KeyError, OSError) as e:
            raise ImageBuildError(f"{image}: {e}") from None
        return {"env": env, "workdir": config.get("WorkingDir") or "/", "user": user, "uid": uid, "gid": gid}

    def oci_archive(self, image: str) -> Path:
        """The built image as an OCI archive in its cache directory (made once): what `apptainer build` converts
        into the SIF a cluster runs (apptainer_build_argv; the SIF goes beside it as image.sif)."""
        archive = self.cache / image[len(IMAGE_PREFIX) :] / "image.oci.tar"
        if not archive.is_file():
            partial = archive.with_suffix(".partial")
            proc = subprocess.run(self.oci_archive_argv(image, partial), capture_output=True, text=True)
            if proc.returncode != 0:
                raise ImageBuildError(f"buildah push {image}: {proc.stderr.strip()[-500:]}")
            partial.rename(archive)
        return archive

    def oci_archive_argv(self, image: str, archive: Path) -> list[str]:
        """The command line that writes a built image as an OCI archive (what `apptainer build` converts)."""
        storage = ["--root", str(self.cache / "storage"), "--runroot", str(self.cache / "run")]
        return [self.buildah, *storage, "push", "--quiet", image, f"oci-archive:{archive}:{image}"]


def build_error(lines: list[str]) -> str:
    """The line of the builder's output that says what went wrong (its last `Error:` line, else its last line):
    first in the cause, since a one-line report shows only the cause's beginning, and RUN steps' warnings
    (pip as root, debconf) come before it."""
    errors = [line for line in lines if line.lstrip().lower().startswith(("error:", "error ", "e: "))]
    return (errors or lines or ["(no output)"])[-1].strip()


TRUST_VARIABLES = ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


def build_host_trust(dockerfile: Path, scratch: Path) -> tuple[Path, list[str]]:
    """(Dockerfile to build, extra buildah arguments) so that RUN steps trust what the build host trusts.

    Where the host reaches registries through a TLS-inspecting proxy ($SSL_CERT_FILE names a bundle with its
    CA), a RUN step's `pip install` or `curl` would fail certificate checks with the image's own bundle. The
    host's bundle is bound read-only at offline_tests.HOST_CA_BUNDLE for the RUN steps only, and a copy of the
    Dockerfile declares TRUST_VARIABLES as build arguments after each FROM: set for RUN steps, never part of
    the image's ENV (ARG, not ENV), so the image is what the task's Dockerfile makes. The digest stays that of
    the task's own Dockerfile. Without $SSL_CERT_FILE: the Dockerfile as it is, nothing added."""
    bundle = os.environ.get("SSL_CERT_FILE", "")
    if not bundle or not os.path.isfile(bundle):
        return dockerfile, []
    lines = []
    for line in dockerfile.read_text().splitlines():
        lines.append(line)
        if line.strip().upper().startswith("FROM ") and not line.rstrip().endswith("\\"):
            lines += [f"ARG {name}" for name in TRUST_VARIABLES]
    copy = scratch / "Dockerfile"
    copy.write_text("\n".join(lines) + "\n")
    args = ["-v", f"{bundle}:{offline_tests.HOST_CA_BUNDLE}:ro"]
    args += [f"--build-arg={name}={offline_tests.HOST_CA_BUNDLE}" for name in TRUST_VARIABLES]
    return copy, args


def apptainer_build_argv(archive: Path, sif: Path, apptainer: str = "apptainer") -> list[str]:
    """The command line that converts an image's OCI archive into the SIF the apptainer backend runs (on a
    cluster node with apptainer; sandbox.apptainer_images maps the task's image to it)."""
    return [apptainer, "build", "--force", str(sif), f"oci-archive:{archive}"]


def build_task_environment(task: Task, builder: ImageBuilder) -> Task:
    """`task` in its built image: `image` gyre-env:<digest>, the working directory the image's WORKDIR (unless
    task.toml sets one) and the initial workspace the files the image has there (COPY'd or made by RUN)."""
    if not task.dockerfile:
        raise ImageBuildError(f"{task.source_path}: no environment/Dockerfile (or compose build) to build")
    spec = BuildSpec(Path(task.dockerfile), Path(task.build_context or Path(task.dockerfile).parent))
    image = builder.build(spec)
    root = image_root(image)
    assert root is not None
    workdir = task.workdir or (root.workdir if root.workdir != "/" else "")
    files, executables = workspace_from_rootfs(root.rootfs, workdir) if workdir else ({}, [])
    directories = empty_directories(root.rootfs, workdir) if workdir else []
    grading = offline_grading(task, image, root)
    return dataclasses.replace(task, image=image, workdir=workdir, files=files, executables=executables,
                               directories=directories, grading=grading)  # fmt: skip


def offline_grading(task: Task, image: str, root: ImageRoot) -> dict[str, Any]:
    """task.grading with what its tests fetch prepared for offline use (gyre/tasks/offline_tests.py), if any."""
    script = task.hidden_files.get(task.grading.get("test_script", ""), "")
    try:
        prepared = offline_tests.prepare(base64.b64decode(script).decode(errors="replace"), image, root)
    except OSError as e:
        raise ImageBuildError(f"{task.source_path}: cannot prepare its tests to run offline: {e}") from None
    if not prepared:
        return task.grading
    made = json.loads((Path(prepared) / "prepared.json").read_text())
    pythons, own = made.get("pythons", []), task.grading.get("env", {})
    offline = offline_tests.offline_env(root.env.get("PATH", "/usr/bin:/bin"), pythons, pip=bool(made.get("pip")))
    if "PYTHONPATH" in offline and own.get("PYTHONPATH"):  # the task's own first
        offline["PYTHONPATH"] = f"{own['PYTHONPATH']}:{offline['PYTHONPATH']}"
    env = {**own, **offline}
    if (python := offline_tests.fallback_python(root)) is not None:
        env["UV_PYTHON"] = python[1]
    return {**task.grading, "env": env, "offline_tests": prepared, "offline_pythons": pythons}


def empty_directories(rootfs: Path, workdir: str) -> list[str]:
    """The directories under the image's working directory that hold no file (a `RUN mkdir -p /app/out` the task
    writes its output to): the workspace has them too, as the container would."""
    top = rootfs / workdir.lstrip("/")
    if not top.is_dir() or top.is_symlink():
        return []
    dirs = [p for p in top.rglob("*") if p.is_dir() and not p.is_symlink()]
    held = lambda d: any(not c.is_symlink() and (c.is_dir() or c.is_file()) for c in d.iterdir())  # noqa: E731
    return sorted(d.relative_to(top).as_posix() for d in dirs if not held(d))


def workspace_from_rootfs(rootfs: Path, workdir: str) -> tuple[dict[str, WorkspaceFile], list[str]]:
    """(files, executable ones) under the image's working directory: what the task starts its agent with. Files
    that are not UTF-8 (a PNG the Dockerfile copied in, a fixture a RUN step made) are kept as bytes."""
    top = rootfs / workdir.lstrip("/")
    if not top.is_dir():
        return {}, []
    if not top.resolve().is_relative_to(rootfs.resolve()):  # an image's symlink, resolved on the host
        raise ImageBuildError(f"the working directory {workdir} is a symlink in the image; make it a directory")
    paths = sorted(p for p in top.rglob("*") if p.is_file() and not p.is_symlink())
    files = as_text({path.relative_to(top).as_posix(): path.read_bytes() for path in paths})
    check_workspace_size(files, f"{workdir} in the built image")
    return files, sorted(rel for rel in files if os.access(top / rel, os.X_OK))
