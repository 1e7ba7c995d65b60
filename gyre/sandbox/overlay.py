"""A writable root for a task's image: an overlay of the image's rootfs whose changes outlive the sandbox.

Harbor runs a task's verifier in the agent's own container, so whatever the agent wrote outside its working
directory (`/output/`, a file under `/srv`) is there for the tests. bwrap 0.8 (Debian 12) has no overlay
options, so the sandbox's command starts in a user and mount namespace of its own (`unshare`), where the
overlay is mounted (`userxattr`: unprivileged) on an empty host directory that bwrap then takes as `/`.
The agent's sandbox writes into `upper` (a host directory beside its workspace, size-watched by the launcher
like the workspace: it is bound read-only at CHANGES_DIR); the grading sandbox stacks those changes,
read-only, between the image and a fresh upper of its own (watched the same way: the tests run the agent's code).

What must stay the image's never becomes writable, in either sandbox: /usr and the other system trees,
/etc (the loader's preload and cache files, NSS), and every directory on the image's PATH with its prefix
(the programs the test script runs, the interpreters and their site-packages): the test script's shell,
which writes the reward, and the interpreters the reward guard admits load only the image's code, and a
program the tests name is the image's, not one the agent put in its place. Before grading, the agent's
changes lose every entry on the way to a grading mount (a /logs symlink, a /tests of its own) and to a
protected tree (a /bin directory in place of the image's /bin link).

Standard library only.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

SYSTEM_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
CHANGES_DIR = "/run/gyre/root-changes"  # the agent's changes, read-only, for the launcher's size watch


@dataclass(frozen=True)
class RootOverlay:
    """The image's rootfs under `layers` (read-only, top first) and a writable `upper`; `work` is overlayfs's
    own (empty, on upper's filesystem); `merged` an empty host directory to mount it on."""

    upper: Path
    work: Path
    merged: Path
    layers: tuple[Path, ...] = ()
    watch_upper: bool = False  # what is written to the root counts against the workspace's size limit

    @classmethod
    def under(cls, directory: Path, layers: tuple[Path, ...] = (), watch_upper: bool = False) -> RootOverlay:
        """upper/, work/ and merged/ made in `directory`."""
        for sub in ("upper", "work", "merged"):
            (directory / sub).mkdir(parents=True, exist_ok=True)
        return cls(directory / "upper", directory / "work", directory / "merged", layers, watch_upper)

    def release(self) -> None:
        """Once the sandbox has ended: overlayfs leaves its work directory mode 000, which a user (not root)
        could not remove with the rest of the rollout's or the grading's scratch."""
        for directory, subdirs, _ in os.walk(self.work):
            for sub in subdirs:
                try:
                    os.chmod(os.path.join(directory, sub), 0o700)
                except OSError:
                    pass

    def mount_prefix(self, rootfs: Path) -> list[str]:
        """The command prefix that mounts the overlay on `merged` in a new user and mount namespace, then runs
        the rest of the command line there."""
        for path in (*self.layers, rootfs, self.upper, self.work, self.merged):
            if "," in str(path) or ":" in str(path):
                raise ValueError(f"cannot overlay {path}: overlayfs options cannot name a path with ',' or ':'")
        lower = ":".join(str(p) for p in (*self.layers, rootfs))
        options = f"userxattr,lowerdir={lower},upperdir={self.upper},workdir={self.work}"
        script = 'mount -t overlay gyre-root -o "$1" "$2" && shift 2 && exec "$@"'
        return [shutil.which("unshare") or "unshare", "--user", "--map-root-user", "--mount", "--", "/bin/sh", "-c",
                script, "sh", options, str(self.merged)]  # fmt: skip


def protected_trees(rootfs: Path, env: dict[str, str]) -> list[str]:
    """The image's directories that stay read-only in an overlaid root: the system trees, and each PATH
    directory outside them with, when it is a `bin`, its prefix (a venv, /opt/conda, /root/.local)."""
    trees = [t for t in SYSTEM_TREES if (rootfs / t[1:]).is_dir() and not (rootfs / t[1:]).is_symlink()]
    for entry in env.get("PATH", "").split(":"):
        path = os.path.normpath(entry) if entry.startswith("/") else ""
        if not path or path == "/" or any(path == t or path.startswith(t + "/") for t in SYSTEM_TREES):
            continue
        tree = os.path.dirname(path) if os.path.basename(path) == "bin" and os.path.dirname(path) != "/" else path
        if (rootfs / tree[1:]).is_dir() and not _through_symlink(rootfs, tree):
            trees.append(tree)
    return sorted(set(trees), key=lambda t: (t.count("/"), t))


def _through_symlink(rootfs: Path, path: str) -> bool:
    parts = [p for p in path.split("/") if p]
    return any(os.path.islink(rootfs.joinpath(*parts[:i])) for i in range(1, len(parts) + 1))


def drop_from_changes(upper: Path, paths: list[str]) -> None:
    """Remove from the agent's changes every entry at or on the way to each of `paths` that is not a plain
    directory (a symlink, a file, a whiteout), and the entry at each path itself: there the image's, or a
    grading mount, is what the grading sandbox sees."""
    for target in paths:
        parts = [p for p in target.split("/") if p not in ("", ".")]
        for i in range(1, len(parts) + 1):
            entry = upper.joinpath(*parts[:i])
            if not os.path.lexists(entry):
                break
            if i == len(parts) or entry.is_symlink() or not entry.is_dir():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
                break
