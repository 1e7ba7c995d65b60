"""Verifiers that run offline: what a task's tests fetch at test time, fetched once at build time instead.

Terminal-Bench 2 style tests install their tools when they run (`curl .../uv/0.9.7/install.sh | sh`, then
`uvx --with pytest==8.4.1 pytest ...`); compute nodes have no network, so as written they fail there. The
prepare step runs on the build host, where PyPI is reachable: it puts the uv those tests name (from PyPI)
into a directory and runs their uvx commands once inside the task's own image, with the network, filling
uv's cache for the image's interpreter. At test time that directory is mounted at UV_DIR (a fresh copy per
grading: uv writes to its cache) with uv and uvx first on PATH and UV_OFFLINE=1, so the same commands
resolve from the cache. Tests that `pip install` their tools (`pip install pytest==8.2.2 && pytest ...`) get
the same treatment: the packages they name are installed at build time, by the image's own pip, into a
directory mounted at PIP_DIR on PYTHONPATH (its scripts on PATH) with PIP_NO_INDEX=1, so that install finds
them already satisfied. Prepared once per (image, commands), in $GYRE_CACHE/offline-tests/<digest>.

A test that still reaches for the network fails; gyre/tasks/harbor_checker.py's `network_hint` says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gyre.sandbox.backends import relocated_python_mounts
from gyre.sandbox.base import host_python
from gyre.sandbox.rootfs import ImageRoot, cache_root, ensure_mountpoint

UV_DIR = "/opt/gyre/uv"  # in the grading sandbox: bin/uv, bin/uvx, cache/
PIP_DIR = "/opt/gyre/pip"  # in the grading sandbox: site/ (on PYTHONPATH), site/bin (on PATH)
DEFAULT_UV_VERSION = "0.9.7"
HOST_CA_BUNDLE = "/opt/gyre/host-ca.crt"  # the build host's $SSL_CERT_FILE, while preparing only
_UV_INSTALLER = re.compile(r"astral\.sh/uv/(\d+\.\d+\.\d+)/install\.sh")
_PIP_INSTALL = re.compile(r"^(?:\S*/)?(?:python3?(?:\.\d+)?\s+-m\s+)?pip3?(?:\.\d+)?\s+install\s")
_REDIRECTION = re.compile(r"\d*>>?&?\s*\S+|<\s*\S+")
_SHELL_SEPARATORS = re.compile(r"&&|\|\||[;|&]")
_PIP_OPTIONS_WITH_VALUE = {"-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url",
                           "-f", "--find-links", "-t", "--target", "--prefix", "--root", "--platform",
                           "--python-version", "--implementation", "--abi", "--trusted-host", "--cache-dir",
                           "--src", "-e", "--editable", "--progress-bar", "--log", "--timeout", "--retries"}  # fmt: skip
_UVX_OPTIONS_WITH_VALUE = {"--with", "-w", "--from", "--python", "-p", "--with-requirements", "--index-url", "-i"}


def uvx_commands(test_script: str) -> list[list[str]]:
    """The uvx (and `uv tool run`) invocations of a test script, up to the tool's name: what to run once to
    fill uv's cache (the tool's own arguments, test paths, are left out; `--version` is run instead)."""
    commands = []
    joined = test_script.replace("\\\n", " ")
    for line in joined.splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        for i, word in enumerate(words):
            rest = (
                words[i + 1 :]
                if word == "uvx"
                else words[i + 3 :]
                if words[i : i + 3] == ["uv", "tool", "run"]
                else None
            )
            if rest is None:
                continue
            head, j = [], 0
            while j < len(rest) and rest[j].startswith("-"):
                head.append(rest[j])
                if rest[j] in _UVX_OPTIONS_WITH_VALUE and j + 1 < len(rest):
                    head.append(rest[j + 1])
                    j += 1
                j += 1
            if j < len(rest):
                commands.append([*head, rest[j], "--version"])
            break
    return commands


def pip_requirements(test_script: str) -> list[str]:
    """The requirements (`pytest==8.2.2`, `numpy`) a test script's `pip install` commands name, in order, each
    once: what to install at build time. Options, requirement files, editables and local paths are left out."""
    requirements: list[str] = []
    joined = test_script.replace("\\\n", " ")
    for line in joined.splitlines():
        for command in _SHELL_SEPARATORS.split(_REDIRECTION.sub(" ", line)):
            command = command.strip()
            if not _PIP_INSTALL.match(command):
                continue
            try:
                words = shlex.split(command, comments=True)
            except ValueError:
                continue
            words = words[words.index("install") + 1 :]
            skip = False
            for word in words:
                if skip:
                    skip = False
                elif word.startswith("-"):
                    skip = word in _PIP_OPTIONS_WITH_VALUE
                elif "/" not in word and not word.startswith(".") and word not in requirements:
                    requirements.append(word)
    return requirements


def uv_version(test_script: str) -> str:
    """The uv version the script installs (astral.sh/uv/<version>/install.sh), else DEFAULT_UV_VERSION."""
    match = _UV_INSTALLER.search(test_script)
    return match.group(1) if match else DEFAULT_UV_VERSION


def uv_tools(version: str) -> Path:
    """A directory with bin/uv and bin/uvx of `version`, from PyPI (made once per machine)."""
    target = cache_root() / "tools" / f"uv-{version}"
    if (target / "bin" / "uv").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".uv-{version}-", dir=target.parent))
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                               "--no-deps", "--target", str(staging), f"uv=={version}"],
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode != 0:
            raise OSError(f"pip install uv=={version} failed: {proc.stderr.strip()[-500:]}")
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def fallback_python(root: ImageRoot) -> tuple[str, str] | None:
    """For an image with no python3 on its PATH: (host prefix, interpreter path in the sandbox) of gyre's own
    interpreter, which every gyre sandbox mounts (its prefix under /usr moved to PYTHON_ROOT); uvx runs the tests
    with it (UV_PYTHON) rather than download one. None when the image has its own."""
    if _image_has(root, "python3"):
        return None
    _, relocate = relocated_python_mounts([])
    return str(Path(sys.base_prefix).resolve()), relocate(host_python())


def _image_has(root: ImageRoot, program: str) -> bool:
    return any(os.path.lexists(root.rootfs / d.lstrip("/") / program) for d in root.env.get("PATH", "").split(":") if d)


def host_pythons(test_script: str, root: ImageRoot) -> list[str]:
    """Prefixes of this machine's interpreters for the Python versions the script's uvx asks for (`-p 3.13`)
    that the image lacks; they are mounted at their own paths and put on PATH, where uv finds them. OSError
    names a version neither has (uv would download it, and the network is not there at test time)."""
    versions = {c[i + 1] for c in uvx_commands(test_script) for i, w in enumerate(c[:-1]) if w in ("-p", "--python")}
    prefixes = []
    for version in sorted(versions):
        if not re.fullmatch(r"\d+\.\d+", version) or _image_has(root, f"python{version}"):
            continue
        found = [Path(p).resolve().parent.parent for p in [shutil.which(f"python{version}")] if p]
        found += sorted((Path.home() / ".pyenv" / "versions").glob(f"{version}.*"))
        usable = [str(f) for f in found if (f / "bin" / f"python{version}").exists() and not str(f).startswith("/usr")]
        if not usable:
            raise OSError(f"uvx asks for Python {version}: the image has none and this machine has none outside "
                          f"/usr (pyenv install {version}, or a RUN step that installs it into the image)")  # fmt: skip
        prefixes.append(usable[0])
    return prefixes


def prepare(test_script: str, image: str, root: ImageRoot, bwrap: str = "bwrap") -> str:
    """The prepared directory (under $GYRE_CACHE/offline-tests) for a test script's uvx commands and pip installs
    in `image`; '' when the script runs neither (or pip installs in an image without pip, which fail there as they
    would with the network). Raises OSError with uv's or pip's output when a command cannot be prepared."""
    commands = uvx_commands(test_script)
    requirements = pip_requirements(test_script) if _image_has(root, "pip") or _image_has(root, "pip3") else []
    if not commands and not requirements:
        return ""
    version = uv_version(test_script)
    pythons = host_pythons(test_script, root)
    what: list[Any] = [
        image,
        version,
        commands,
        fallback_python(root),
        pythons,
        *([requirements] if requirements else []),
    ]
    key = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:24]
    out = cache_root() / "offline-tests" / key
    if (out / "prepared.json").is_file():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=out.parent))
    try:
        if commands:
            shutil.copytree(uv_tools(version) / "bin", staging / "bin")
        else:
            (staging / "bin").mkdir()
        (staging / "cache").mkdir()
        for command in commands:
            _run_online(bwrap, root, staging, ["uvx", *command], pythons)
        if requirements:
            (staging / "pip" / "site").mkdir(parents=True)
            _run_online(bwrap, root, staging, ["python3", "-m", "pip", "install", "--quiet", "--no-cache-dir",
                                               "--disable-pip-version-check", "--target", f"{PIP_DIR}/site",
                                               *requirements], pythons)  # fmt: skip
        (staging / "prepared.json").write_text(json.dumps(
            {"image": image, "uv": version, "commands": commands, "pythons": pythons, "pip": requirements}
        ))  # fmt: skip
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(out)


def _run_online(bwrap: str, root: ImageRoot, uv_dir: Path, argv: list[str], pythons: list[str]) -> None:
    """`argv` in the image with the host's network, uv's directory writable: the build-time half of a test."""
    for target in ("/proc", "/dev", "/tmp", UV_DIR):
        ensure_mountpoint(root.rootfs, target)
    host_files = ["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"] if os.path.exists("/etc/resolv.conf") else []
    env = {**root.env, **offline_env(root.env.get("PATH", "/usr/bin:/bin"), pythons), "HOME": "/tmp", "UV_OFFLINE": "0",
           "PIP_BREAK_SYSTEM_PACKAGES": "1"}  # fmt: skip
    ca_bundle = os.environ.get("SSL_CERT_FILE", "")
    if ca_bundle and os.path.isfile(ca_bundle):  # the build host's trust (a site's TLS proxy), not the image's
        host_files += ["--ro-bind", ca_bundle, HOST_CA_BUNDLE]
        env["SSL_CERT_FILE"] = env["PIP_CERT"] = HOST_CA_BUNDLE  # pip trusts its own bundle, not SSL_CERT_FILE
    for target in host_files[2::3]:
        ensure_mountpoint(root.rootfs, target, is_file=True)
    if (python := fallback_python(root)) is not None:
        prefix, env["UV_PYTHON"] = python
        _, relocate = relocated_python_mounts([])
        ensure_mountpoint(root.rootfs, relocate(prefix))
        host_files += ["--ro-bind", prefix, relocate(prefix)]
    for prefix in pythons:
        ensure_mountpoint(root.rootfs, prefix)
        host_files += ["--ro-bind", prefix, prefix]
    cmd = [bwrap, "--unshare-all", "--share-net", "--die-with-parent", "--ro-bind", str(root.rootfs), "/",
           *host_files, "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", str(uv_dir), UV_DIR,
           *_pip_bind(uv_dir, root), "--chdir", "/tmp", "--clearenv", *(a for k, v in env.items() for a in ("--setenv", k, v)), "--", *argv]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise OSError(f"preparing `{shlex.join(argv)}` in the image failed (exit {proc.returncode}):\n{tail}")


def _pip_bind(uv_dir: Path, root: ImageRoot) -> list[str]:
    """While preparing: the staging directory's pip/ (if any) writable at PIP_DIR, where pip installs."""
    if not (uv_dir / "pip").is_dir():
        return []
    ensure_mountpoint(root.rootfs, PIP_DIR)
    return ["--bind", str(uv_dir / "pip"), PIP_DIR]


def offline_env(path: str, pythons: list[str] = [], pip: bool = False) -> dict[str, str]:  # noqa: B006 (never mutated)
    """What a test sees of the prepared directory: uv first on PATH (then the host interpreters it was prepared
    with), its cache, no network, no downloads; with `pip`, the packages its pip installs name, on PYTHONPATH
    and their scripts on PATH, and pip told to use no index (so the install finds them already satisfied and
    an unprepared one fails at once) and to install as the image's own pip would (a stand-in base's Debian
    python3 marks itself externally managed; the python:3.x-slim images do not)."""
    path = ":".join([f"{UV_DIR}/bin", *([f"{PIP_DIR}/site/bin"] if pip else []), *(f"{p}/bin" for p in pythons), path])
    env = {"PATH": path, "UV_CACHE_DIR": f"{UV_DIR}/cache", "UV_OFFLINE": "1",
           "UV_PYTHON_DOWNLOADS": "never", "UV_NO_PROGRESS": "1"}  # fmt: skip
    if pip:
        env.update(PYTHONPATH=f"{PIP_DIR}/site", PIP_NO_INDEX="1", PIP_BREAK_SYSTEM_PACKAGES="1",
                   PIP_DISABLE_PIP_VERSION_CHECK="1")  # fmt: skip
    return env
