"""Make the common base images here, from the Debian archive: `python -m tools.make_base_images [NAME ...]`.

No container registry is reachable from this kind of machine, so the images task Dockerfiles name in FROM
are made locally and kept as OCI archives in a local store (default $GYRE_CACHE/bases, e.g.
~/.cache/gyre/bases/debian_bookworm.tar) that gyre/tasks/images.py imports from:

    debian:bookworm     mmdebstrap --variant=minbase bookworm (the Debian archive, or --mirror)
    python:3.11-slim    debian:bookworm + Debian's python3, python3-pip, python3-venv (python, pip on PATH,
                        pip allowed to install system-wide as in the python image)

Each is made once (skipped when its archive exists; --force remakes it). Other bases (ubuntu:24.04, other
Pythons) go into the store as OCI archives made where a registry is reachable: `skopeo copy
docker://ubuntu:24.04 oci-archive:ubuntu_24.04.tar`.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gyre.fsutil import locked
from gyre.sandbox.rootfs import cache_root
from gyre.tasks.images import ImageBuilder, ImageBuildError, archive_stem, qualified

DEBIAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PYTHON_SLIM = f"""FROM debian:bookworm
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \\
      python3 python3-pip python3-venv ca-certificates \\
 && ln -s /usr/bin/python3 /usr/local/bin/python && ln -s /usr/bin/pip3 /usr/local/bin/pip \\
 && rm -f /usr/lib/python3.11/EXTERNALLY-MANAGED && rm -rf /var/lib/apt/lists/*
ENV PATH={DEBIAN_PATH} LANG=C.UTF-8
CMD ["python3"]
"""
BASES = ("debian:bookworm", "python:3.11-slim")


def make_debian(builder: ImageBuilder, name: str, mirror: str) -> None:
    """A minimal Debian bookworm root filesystem from the archive, committed as image `name`."""
    if shutil.which("mmdebstrap") is None:
        raise ImageBuildError("`mmdebstrap` is not on PATH: apt-get install mmdebstrap (tools/setup_env.sh does)")
    with tempfile.TemporaryDirectory(prefix="gyre-base-") as tmp:
        tar = Path(tmp) / "rootfs.tar"
        cmd = ["mmdebstrap", "--variant=minbase", "--format=tar", "bookworm", str(tar), *([mirror] if mirror else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ImageBuildError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-800:]}")
        container = _ok(builder.run("from", "--quiet", "scratch")).strip()
        try:
            _ok(builder.run("add", "--quiet", container, str(tar), "/"))
            _ok(builder.run("config", "--env", f"PATH={DEBIAN_PATH}", "--cmd", "bash", container))
            _ok(builder.run("commit", "--quiet", container, qualified(name)))
        finally:
            builder.run("rm", container)


def make_from_dockerfile(builder: ImageBuilder, name: str, dockerfile: str) -> None:
    with tempfile.TemporaryDirectory(prefix="gyre-base-") as tmp:
        (Path(tmp) / "Dockerfile").write_text(dockerfile)
        _ok(builder.run("bud", "--isolation", "chroot", "--pull=never", "--quiet", "-t", qualified(name), tmp))


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    if proc.returncode != 0:
        raise ImageBuildError(f"buildah {proc.args[5:8]}... failed: {(proc.stderr or proc.stdout).strip()[-800:]}")
    return proc.stdout


def make_base(builder: ImageBuilder, name: str, store: Path, mirror: str = "", force: bool = False) -> Path:
    """The OCI archive of base `name` in `store`, made unless it is there (one maker at a time per store)."""
    archive = store / f"{archive_stem(name)}.tar"
    if archive.exists() and not force:
        return archive
    store.mkdir(parents=True, exist_ok=True)
    with locked(store / f".{archive_stem(name)}.lock"):
        if archive.exists() and not force:
            return archive
        return _make_base(builder, name, archive, mirror, force)


def _make_base(builder: ImageBuilder, name: str, archive: Path, mirror: str, force: bool) -> Path:
    if force or not builder.has_image(qualified(name)):
        if name == "debian:bookworm":
            make_debian(builder, name, mirror)
        elif name == "python:3.11-slim":
            make_base(builder, "debian:bookworm", archive.parent, mirror)
            builder.ensure_base("debian:bookworm")
            make_from_dockerfile(builder, name, PYTHON_SLIM)
        else:
            raise ImageBuildError(f"no recipe for base {name!r}; this tool makes {', '.join(BASES)}")
    partial = archive.with_suffix(".tar.partial")
    partial.unlink(missing_ok=True)
    _ok(builder.run("push", "--quiet", qualified(name), f"oci-archive:{partial}:{name}"))
    partial.rename(archive)
    return archive


def stand_in(builder: ImageBuilder, name: str, base: str, store: Path) -> Path:
    """Store `base` under another image's name (`--stand-in ubuntu:24.04=debian:bookworm`): a user's explicit
    choice to run tasks written for an image this machine cannot get on one it can make; it is not that image."""
    make_base(builder, base, store)
    _ok(builder.run("tag", qualified(base), qualified(name)))
    archive = store / f"{archive_stem(name)}.tar"
    archive.unlink(missing_ok=True)
    _ok(builder.run("push", "--quiet", qualified(name), f"oci-archive:{archive}:{name}"))
    return archive


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("names", nargs="*", help=f"bases to make (default: {' '.join(BASES)}, unless --stand-in)")
    p.add_argument("--store", type=Path, default=cache_root() / "bases", help="where the OCI archives go")
    p.add_argument("--mirror", default="", help="Debian mirror for mmdebstrap (default: the archive)")
    p.add_argument("--force", action="store_true", help="remake bases that exist")
    p.add_argument("--stand-in", action="append", default=[], metavar="NAME=BASE",
                   help="also store BASE under NAME (e.g. ubuntu:24.04=debian:bookworm): not NAME, a stand-in for it")  # fmt: skip
    args = p.parse_args(argv)
    builder = ImageBuilder(stores=[args.store])
    for pair in args.stand_in:
        name, _, base = pair.partition("=")
        print(f"{name}: stand-in {stand_in(builder, name, base, args.store)} (it is {base})", flush=True)
    for name in args.names or ([] if args.stand_in else BASES):
        started = time.monotonic()
        try:
            archive = make_base(builder, name, args.store, args.mirror, args.force)
        except ImageBuildError as e:
            print(f"{name}: FAILED: {e}", file=sys.stderr)
            return 1
        print(f"{name}: {archive} ({time.monotonic() - started:.1f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
