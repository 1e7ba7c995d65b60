"""Unpacked environment images: the read-only root filesystems bwrap runs a task's rollouts and grading in.

gyre/tasks/images.py builds a task's Dockerfile with buildah and unpacks the image once into the machine's
image cache ($GYRE_CACHE, else ~/.cache/gyre; `images/<digest>/`): `rootfs/` (the image's files) and
`image.json` (its ENV, WORKDIR and USER resolved to a uid). A task built that way names its image
`gyre-env:<digest>`; the bwrap backend then uses that rootfs as `/` instead of the host's /usr.

Standard library only: the sandbox backends import it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

IMAGE_PREFIX = "gyre-env:"  # the image name of a task built by gyre/tasks/images.py: gyre-env:<digest>
CACHE_ENV = "GYRE_CACHE"


def cache_root() -> Path:
    """The machine-level cache (images, bases, verifier caches): $GYRE_CACHE, else ~/.cache/gyre."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "gyre").expanduser()


def images_dir() -> Path:
    return cache_root() / "images"


@dataclass(frozen=True)
class ImageRoot:
    """An unpacked image: its root filesystem and the runtime settings of its config."""

    rootfs: Path
    env: dict[str, str]
    workdir: str
    uid: int
    gid: int

    @classmethod
    def load(cls, image_dir: Path) -> ImageRoot:
        meta = json.loads((image_dir / "image.json").read_text())
        return cls(image_dir / "rootfs", dict(meta["env"]), meta["workdir"], int(meta["uid"]), int(meta["gid"]))


def is_built_image(image: str) -> bool:
    return image.startswith(IMAGE_PREFIX)


def image_root(image: str) -> ImageRoot | None:
    """The unpacked rootfs of a `gyre-env:<digest>` image, None for any other image name; FileNotFoundError
    when the image was built elsewhere and is not in this machine's cache."""
    if not is_built_image(image):
        return None
    image_dir = images_dir() / image[len(IMAGE_PREFIX) :]
    if not (image_dir / "image.json").is_file():
        raise FileNotFoundError(
            f"environment image {image} is not unpacked in {images_dir()} (set {CACHE_ENV} to the cache it was "
            "built in, or build it here: python -m tools.check_tasks / tasks.build_images=true)"
        )
    return ImageRoot.load(image_dir)


def ensure_mountpoint(rootfs: Path, target: str, is_file: bool = False) -> None:
    """Create the empty directory (or file) bwrap mounts `target` on: the rootfs is read-only in the sandbox,
    so a mount point it lacks must exist before. Idempotent; never touches an existing path but an empty
    directory where a file (or socket) is to be mounted."""
    parts = [part for part in target.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"mount point {target!r} leaves the image's root")
    path = rootfs.joinpath(*parts)
    if is_file and path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
        path.rmdir()  # an empty directory made for a file mount by an earlier gyre: bwrap needs a file there
    if os.path.lexists(path):
        return
    for i in range(1, len(parts)):  # the host makes it: an image's symlink must not lead it outside the rootfs
        if os.path.islink(rootfs.joinpath(*parts[:i])):
            raise ValueError(f"cannot mount on {target}: /{'/'.join(parts[:i])} is a symlink in the image")
    if is_file:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
    else:
        path.mkdir(parents=True, exist_ok=True)


def passwd_ids(rootfs: Path, user: str) -> tuple[int, int]:
    """(uid, gid) of a Dockerfile USER (`name`, `uid`, `name:group`, `uid:gid`) from the image's /etc/passwd
    and /etc/group; (0, 0) for an empty USER (root). KeyError names a user the image does not have."""
    if not user:
        return 0, 0
    name, _, group = user.partition(":")

    def lookup(file: str, key: str) -> list[str]:
        for line in (rootfs / "etc" / file).read_text(errors="replace").splitlines():
            fields = line.split(":")
            if len(fields) > 3 and key in (fields[0], fields[2]):
                return fields
        raise KeyError(f"USER {user!r}: {key!r} is not in the image's /etc/{file}")

    if name.isdigit():
        uid, gid = int(name), int(name)
        try:
            gid = int(lookup("passwd", name)[3])
        except (KeyError, OSError):
            pass
    else:
        fields = lookup("passwd", name)
        uid, gid = int(fields[2]), int(fields[3])
    if group:
        gid = int(group) if group.isdigit() else int(lookup("group", group)[2])
    return uid, gid


def user_files(root: ImageRoot, uid: int, home: str) -> dict[str, Path]:
    """Copies of the image's /etc/passwd and /etc/group with an entry for `uid` added where the image has none
    (made once per image beside its rootfs), keyed by where they are bound; {} when the image names `uid`.
    A root image runs as the sandbox uid, which the image's files do not know: without an entry, tools that look
    the user up (ssh-keygen, whoami, git's ident) fail with "No user exists for uid 1000", where under Docker they
    run as root and find one."""
    etc = root.rootfs / "etc"
    try:
        passwd = (etc / "passwd").read_text(errors="replace")
    except OSError:
        passwd = ""
    if any(line.split(":")[2:3] == [str(uid)] for line in passwd.splitlines()):
        return {}
    try:
        group = (etc / "group").read_text(errors="replace")
    except OSError:
        group = ""
    made: dict[str, Path] = {}
    for name, text, entry in (("passwd", passwd, f"agent:x:{uid}:{uid}:agent:{home}:/bin/sh"),
                              ("group", group, f"agent:x:{uid}:")):  # fmt: skip
        path = root.rootfs.parent / f"etc-{name}-{uid}"
        if not path.is_file():
            staging = path.with_name(f".{path.name}.{os.getpid()}")
            staging.write_text(text + ("" if not text or text.endswith("\n") else "\n") + entry + "\n")
            staging.replace(path)
        made[f"/etc/{name}"] = path
    return made
