"""What runs in a sandbox, and the one interface the backends (bwrap, apptainer, none) implement.

A job names its command, working directory and environment as the sandbox sees them, and the host
directories it gets (`Mount`: the workspace writable, code read-only); nothing else of the host is
there. `proxy_socket` is the rollout's proxy endpoint (a Unix socket on the host): an isolated
backend binds it at SOCKET_PATH and the launcher (gyre/sandbox/inside.py) relays the sandbox's own
127.0.0.1:RELAY_PORT to it, so `http://127.0.0.1:RELAY_PORT` is the only address that answers.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import gyre
from gyre.config.schema import SandboxConfig
from gyre.errors import UserError
from gyre.sandbox.overlay import CHANGES_DIR, RootOverlay

# Fixed paths inside an isolated sandbox
WORKSPACE = "/workspace"
HARNESS_DIR = "/run/gyre/harness"  # task file in, result file out
SOCKET_PATH = "/run/gyre/proxy.sock"
GYRE_ROOT = "/opt/gyre"  # the gyre package (and .gyre/node) read-only, importable from here
HOME = "/home/agent"
RELAY_PORT = 41000
SANDBOX_UID = 1000  # not root inside: no capabilities, so /proc of non-dumpable processes stays closed

SOURCE_ROOT = Path(gyre.__file__).resolve().parent.parent  # the checkout or site-packages holding gyre
INSIDE_SCRIPT = Path(__file__).resolve().with_name("inside.py")
# Environment variables a sandboxed process may inherit from the host (plus SandboxConfig.env)
ENV_ALLOWLIST = ("LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM")
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"


class SandboxUnavailable(UserError, RuntimeError):
    """The configured sandbox cannot run here; the message says what to install or set."""


@dataclass(frozen=True)
class Mount:
    source: Path
    target: str
    writable: bool = False


@dataclass
class SandboxJob:
    argv: list[str]  # paths as the sandbox sees them (see Sandbox.place)
    cwd: str
    env: dict[str, str] = field(default_factory=dict)  # added to the sandbox's base environment
    mounts: list[Mount] = field(default_factory=list)
    proxy_socket: Path | None = None  # host Unix socket relayed to 127.0.0.1:RELAY_PORT inside
    started_fd: int = -1  # pipe the launcher writes "started" to once the sandbox is up
    image: str = ""  # the task's environment image (apptainer: sandbox.apptainer_images maps it to a .sif)
    overlay: RootOverlay | None = None  # bwrap with a built image: the image's root writable (gyre/sandbox/overlay.py)


class Sandbox(Protocol):
    name: str
    isolated: bool  # False only for backend none: host paths, host network, host environment

    def command(self, job: SandboxJob) -> list[str]:
        """The host command line that runs `job` in a fresh sandbox."""
        ...

    def base_env(self) -> dict[str, str]:
        """The environment every sandboxed process starts from (before the job's own variables)."""
        ...

    @property
    def python(self) -> str:
        """The interpreter to name in a job's argv."""
        ...


def place(sandbox: Sandbox, mount: Mount) -> str:
    """Where a mounted host path appears to the job: its target, or the host path itself without isolation."""
    return mount.target if sandbox.isolated else str(mount.source)


def host_env(sandbox: Sandbox, job: SandboxJob) -> dict[str, str]:
    """The environment of the host command: an isolated sandbox sets the job's own inside (--clearenv)."""
    if sandbox.isolated:
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    return {**sandbox.base_env(), **job.env}


def host_python() -> str:
    """The base interpreter (not a venv's symlink): its prefix is what an isolated sandbox mounts."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def code_mounts() -> list[Mount]:
    """Read-only code every harness needs: the interpreter's prefix, the gyre package, .gyre/node (Claude Code),
    .gyre/mini-swe-agent (its venv)."""
    mounts = [Mount(Path(sys.base_prefix).resolve(), str(Path(sys.base_prefix).resolve()))]
    mounts.append(Mount(SOURCE_ROOT / "gyre", f"{GYRE_ROOT}/gyre"))
    for tool in ("node", "mini-swe-agent"):  # Claude Code; mini-swe-agent's venv
        path = SOURCE_ROOT / ".gyre" / tool
        if path.is_dir():
            mounts.append(Mount(path, f"{GYRE_ROOT}/.gyre/{tool}"))
    return mounts


def allowlisted_env(cfg: SandboxConfig, source: dict[str, str] | None = None) -> dict[str, str]:
    source = dict(os.environ if source is None else source)
    names = (*ENV_ALLOWLIST, *cfg.env)
    env = {k: source[k] for k in names if k in source}
    env.update(PATH=SANDBOX_PATH, HOME=HOME, TMPDIR="/tmp", PYTHONPATH=GYRE_ROOT, PYTHONDONTWRITEBYTECODE="1")
    return env


def launcher_argv(python: str, cfg: SandboxConfig, job: SandboxJob) -> list[str]:
    """The in-sandbox launcher's command line (limits, relay, start signal), then the job's argv."""
    argv = [python, "-I", "-S", f"{GYRE_ROOT}/gyre/sandbox/inside.py",
            "--fsize", str(cfg.file_size_mb << 20), "--nofile", str(cfg.open_files), "--nproc", str(cfg.processes),
            "--as", str(cfg.memory_mb << 20)]  # fmt: skip
    if cfg.seccomp:
        argv.append("--seccomp")
    if job.proxy_socket is not None:
        argv += ["--relay", f"{RELAY_PORT}:{SOCKET_PATH}", "--connections", str(cfg.relay_connections)]
    if any(m.target == WORKSPACE and m.writable for m in job.mounts):
        argv += ["--watch", f"{WORKSPACE}:{cfg.workspace_mb << 20}"]
    if job.overlay is not None and job.overlay.watch_upper:  # the agent's changes to the root: the same limit
        argv += ["--watch", f"{CHANGES_DIR}:{cfg.workspace_mb << 20}"]
    if job.started_fd >= 0:
        argv += ["--started", str(job.started_fd)]
    return [*argv, "--", *job.argv]
