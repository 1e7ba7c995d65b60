"""The sandbox backends: bubblewrap (local, Debian's `bubblewrap`), Apptainer (clusters) and none.

bwrap: new user (uid 1000, no capabilities, no further user namespaces), PID, network, IPC, UTS and
cgroup namespaces; a read-only root of its own with /usr (and the /bin, /lib symlinks) and a few /etc
files read-only, the job's mounts, a private /tmp and HOME (size-limited tmpfs), /proc and a minimal
/dev; a pids cgroup of its own when the run is root (gyre/sandbox/limits.py). `--die-with-parent` and the PID namespace end
every process when the launcher or the runner goes. apptainer: `exec --containall --no-home
--cleanenv` with no network and the same binds, in the configured image. none: the job as a plain
host process with the host environment (rollout ids and paths as on the host).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from gyre.config.schema import SandboxConfig
from gyre.sandbox import rootfs
from gyre.sandbox.base import (
    HOME,
    SANDBOX_UID,
    SOCKET_PATH,
    SOURCE_ROOT,
    Mount,
    Sandbox,
    SandboxJob,
    SandboxUnavailable,
    allowlisted_env,
    host_python,
    launcher_argv,
)
from gyre.sandbox.limits import pids_prefix
from gyre.sandbox.rootfs import ImageRoot
from gyre.sandbox.userns import userns_refusal

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# /etc entries programs need to start (users, libraries, certificates, time zone); never all of /etc
ETC_ENTRIES = ("passwd", "group", "nsswitch.conf", "hosts", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
               "localtime", "ssl", "ca-certificates", "alternatives", "mime.types")  # fmt: skip


class BwrapSandbox:
    name = "bwrap"
    isolated = True

    def __init__(self, cfg: SandboxConfig, bwrap: str = "bwrap") -> None:
        self.cfg = cfg
        self.bwrap = bwrap

    @property
    def python(self) -> str:
        return host_python()

    def base_env(self) -> dict[str, str]:
        return allowlisted_env(self.cfg)

    def system_args(self) -> list[str]:
        args: list[str] = []
        for path in SYSTEM_DIRS:
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        for entry in ETC_ENTRIES:
            if os.path.exists(f"/etc/{entry}"):
                args += ["--ro-bind", f"/etc/{entry}", f"/etc/{entry}"]
        return args

    def command(self, job: SandboxJob) -> list[str]:
        root = self.image_root(job.image)
        if root is not None:
            return self.image_command(job, root)
        argv = [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session",
                "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
                *self.system_args(), "--proc", "/proc", "--dev", "/dev", *self.scratch_args()]  # fmt: skip
        for m in job.mounts:
            argv += ["--bind" if m.writable else "--ro-bind", str(m.source), m.target]
        if job.proxy_socket is not None:
            argv += ["--bind", str(job.proxy_socket), SOCKET_PATH]
        argv += ["--remount-ro", "/", "--chdir", job.cwd, "--clearenv"]  # the root: read-only; binds as given
        for key, value in {**self.base_env(), **job.env}.items():
            argv += ["--setenv", key, value]
        return [*pids_prefix(self.cfg.processes), *argv, "--", *launcher_argv(self.python, self.cfg, job)]

    def scratch_args(self) -> list[str]:
        """/tmp and HOME: tmpfs of bounded size (host memory, charged as written; a filler gets ENOSPC); no
        user namespace inside the sandbox (--disable-userns needs --unshare-user named)."""
        return ["--size", str(self.cfg.tmp_mb << 20), "--tmpfs", "/tmp", "--size", str(self.cfg.home_mb << 20),
                "--tmpfs", HOME, "--unshare-user", "--disable-userns"]  # fmt: skip

    @staticmethod
    def image_root(image: str) -> ImageRoot | None:
        """The unpacked rootfs of a task image built by gyre (gyre-env:<digest>); None: the host's /usr."""
        try:
            return rootfs.image_root(image)
        except (FileNotFoundError, OSError, ValueError, KeyError) as e:
            raise SandboxUnavailable(str(e)) from None

    def image_command(self, job: SandboxJob, root: ImageRoot) -> list[str]:
        """The job in a task's own image: its rootfs as `/` (read-only, shared), its ENV, its USER's uid (root:
        the sandbox uid, never root), the job's mounts (the workspace the only writable tree) and the host's
        interpreter for gyre's own processes (moved to PYTHON_ROOT when it lives in /usr, which the image owns)."""
        uid, gid = (root.uid, root.gid) if root.uid else (SANDBOX_UID, SANDBOX_UID)
        mounts, relocate = relocated_python_mounts(job.mounts)
        argv = [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--uid", str(uid),
                "--gid", str(gid), "--hostname", "sandbox", "--ro-bind", str(root.rootfs), "/",
                "--proc", "/proc", "--dev", "/dev", *self.scratch_args()]  # fmt: skip
        for m in mounts:
            argv += ["--bind" if m.writable else "--ro-bind", str(m.source), m.target]
        try:
            users = rootfs.user_files(root, uid, HOME) if not root.uid else {}
        except OSError:  # a read-only image cache: run without the entry rather than not at all
            users = {}
        for target, source in users.items():
            argv += ["--ro-bind", str(source), target]
        if job.proxy_socket is not None:
            argv += ["--bind", str(job.proxy_socket), SOCKET_PATH]
        points = (
            [(t, False) for t in ("/proc", "/dev", "/tmp", HOME)]
            + [(t, True) for t in users]
            + [
                (m.target, not m.source.is_dir())
                for m in mounts  # a file or a socket
            ]
        )
        try:  # what bwrap mounts on must exist in the read-only root
            for target, is_file in [*points, *([(SOCKET_PATH, True)] if job.proxy_socket is not None else [])]:
                rootfs.ensure_mountpoint(root.rootfs, target, is_file)
        except (OSError, ValueError) as e:
            raise SandboxUnavailable(f"image {job.image}: {e}") from None
        argv += ["--chdir", job.cwd, "--clearenv"]
        for key, value in image_env(root.env, self.base_env(), job.env).items():
            argv += ["--setenv", key, value]
        launcher = map(relocate, launcher_argv(self.python, self.cfg, job))
        return [*pids_prefix(self.cfg.processes), *argv, "--", *launcher]


PYTHON_ROOT = "/opt/gyre/python"  # the host interpreter's prefix in an image, when the host's is under /usr


def relocated_python_mounts(mounts: list[Mount]) -> tuple[list[Mount], Callable[[str], str]]:
    """The job's mounts with the host interpreter's prefix moved to PYTHON_ROOT when it is a system directory
    (Debian's python3: /usr), and the function that rewrites paths under it; unchanged otherwise (a pyenv or
    uv interpreter keeps its own path, which its RUNPATH names)."""
    prefix = str(Path(sys.base_prefix).resolve())
    if not any(prefix == d or prefix.startswith(d + "/") for d in SYSTEM_DIRS):
        return list(mounts), lambda path: path

    def relocate(path: str) -> str:
        return PYTHON_ROOT + path[len(prefix) :] if path == prefix or path.startswith(prefix + "/") else path

    return [Mount(m.source, relocate(m.target), m.writable) if str(m.source) == prefix else m for m in mounts], relocate


def image_env(image: dict[str, str], base: dict[str, str], job: dict[str, str]) -> dict[str, str]:
    """The image's ENV (its PATH first of all), then gyre's base variables (HOME, TMPDIR; PYTHONPATH before the
    image's), then the job's."""
    env = {**base, **{k: v for k, v in image.items() if k != "HOME"}}
    if "PYTHONPATH" in image and "PYTHONPATH" in base:
        env["PYTHONPATH"] = f"{base['PYTHONPATH']}:{image['PYTHONPATH']}"
    return {**env, **job}


class ApptainerSandbox:
    name = "apptainer"
    isolated = True

    def __init__(self, cfg: SandboxConfig, apptainer: str = "apptainer") -> None:
        self.cfg = cfg
        self.apptainer = apptainer

    @property
    def python(self) -> str:
        return host_python()  # bound from the host: the image must carry a compatible C library

    def base_env(self) -> dict[str, str]:
        return allowlisted_env(self.cfg)

    def command(self, job: SandboxJob) -> list[str]:
        argv = [self.apptainer, "exec", "--containall", "--no-home", "--cleanenv", "--net", "--network", "none",
                "--pwd", job.cwd]  # fmt: skip
        for m in job.mounts:
            argv += ["--bind", f"{m.source}:{m.target}:{'rw' if m.writable else 'ro'}"]
        if job.proxy_socket is not None:
            argv += ["--bind", f"{job.proxy_socket}:{SOCKET_PATH}"]
        for key, value in {**self.base_env(), **job.env}.items():
            if key != "HOME":  # --containall gives a private, empty HOME; apptainer refuses to override it
                argv += ["--env", f"{key}={value}"]
        return [*argv, self.image_for(job.image), *launcher_argv(self.python, self.cfg, job)]

    def image_for(self, image: str) -> str:
        """The .sif a task's image maps to (sandbox.apptainer_images), else sandbox.apptainer_image."""
        return image_file(self.cfg, image)


def image_file(cfg: SandboxConfig, image: str) -> str:
    """The .sif for a task's environment image: its entry in apptainer_images, else apptainer_image (the
    image of tasks that name none, and of every task when no mapping is given)."""
    if image and image in cfg.apptainer_images:
        return cfg.apptainer_images[image]
    if rootfs.is_built_image(image):  # built by gyre/tasks/images.py: its SIF sits beside its OCI archive
        sif = rootfs.images_dir() / image[len(rootfs.IMAGE_PREFIX) :] / "image.sif"
        if not sif.is_file():
            raise SandboxUnavailable(
                f"no .sif for task image {image}: `apptainer build {sif} oci-archive:{sif.with_name('image.oci.tar')}` "
                "(gyre.tasks.images: ImageBuilder.oci_archive writes the archive, apptainer_build_argv the command)"
            )
        return str(sif)
    if image and cfg.apptainer_images:
        raise SandboxUnavailable(
            f"task image {image!r} has no entry in sandbox.apptainer_images (known: {sorted(cfg.apptainer_images)}); "
            f"convert it (apptainer build NAME.sif docker://{image}) and map it"
        )
    if not cfg.apptainer_image:
        raise SandboxUnavailable(f"no .sif for task image {image!r}: set sandbox.apptainer_images or apptainer_image")
    return cfg.apptainer_image


class NoSandbox:
    """backend=none: the host itself. Asked for only; every shard records it."""

    name = "none"
    isolated = False

    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg

    @property
    def python(self) -> str:
        return sys.executable

    def base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(SOURCE_ROOT), *filter(None, [env.get("PYTHONPATH")])])
        return env

    def command(self, job: SandboxJob) -> list[str]:
        return list(job.argv)


@functools.cache
def _bwrap_works(bwrap: str) -> str:
    """'' when a trivial bwrap sandbox runs here, else why not."""
    sandbox = BwrapSandbox(SandboxConfig())
    probe = [bwrap, "--unshare-all", "--die-with-parent", *sandbox.system_args(),
             "--proc", "/proc", "--dev", "/dev", *sandbox.scratch_args(), "--", "true"]  # fmt: skip
    try:
        proc = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    return "" if proc.returncode == 0 else (proc.stderr.strip() or f"exit code {proc.returncode}")


def check_task_images(cfg: SandboxConfig, images: Iterable[str]) -> None:
    """backend=apptainer: every task image has a .sif (raises SandboxUnavailable naming the first that has not)."""
    if cfg.backend == "apptainer":
        for image in sorted(set(images)):
            image_file(cfg, image)


def make_sandbox(cfg: SandboxConfig) -> Sandbox:
    """The configured backend, checked to run here; SandboxUnavailable says what to do if it cannot."""
    if cfg.backend == "none":
        return NoSandbox(cfg)
    if cfg.backend == "apptainer":
        apptainer = shutil.which("apptainer")
        if apptainer is None:
            raise SandboxUnavailable("sandbox.backend=apptainer but `apptainer` is not on PATH")
        for key, sif in [("apptainer_image", cfg.apptainer_image),
                         *((f"apptainer_images[{k!r}]", v) for k, v in cfg.apptainer_images.items())]:  # fmt: skip
            if sif and not Path(sif).exists():
                raise SandboxUnavailable(f"sandbox.{key}={sif!r} does not exist")
        return ApptainerSandbox(cfg, apptainer)
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "sandbox.backend=bwrap but `bwrap` is not on PATH: install bubblewrap (apt-get install bubblewrap, "
            "or run tools/setup_env.sh), or set sandbox.backend=none to run harnesses unsandboxed"
        )
    refusal = userns_refusal()
    if refusal:
        raise SandboxUnavailable(refusal)
    why = _bwrap_works(bwrap)
    if why:
        raise SandboxUnavailable(
            f"bubblewrap cannot create a sandbox here ({why}); user namespaces may be disabled "
            "(sysctl kernel.unprivileged_userns_clone=1), or bubblewrap may be older than 0.8 (--size, "
            "--disable-userns); or set sandbox.backend=none"
        )
    return BwrapSandbox(cfg, bwrap)
