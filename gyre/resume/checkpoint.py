"""Writing and reading `output_dir/checkpoint/`: trainer, RNG states and the run's state, atomically.

The new checkpoint is written in full to `checkpoint.tmp/` (state.json last, every file fsynced),
then swapped in: `checkpoint/` -> `checkpoint.old/`, `checkpoint.tmp/` -> `checkpoint/`, then
`checkpoint.old/` is removed. A crash at any point leaves a complete checkpoint in `checkpoint/`
or, only between the two renames, in `checkpoint.old/`; `state.find_checkpoint` looks in that order.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from gyre.fsutil import fsync_path
from gyre.resume.state import RunState, checkpoint_paths, read_state, write_state

TRAINER_FILE = "trainer"  # a directory: sharded (gyre.train.dist_checkpoint)
RNG_FILE = "rng.pt"
LEGACY_TRAINER_FILE = "trainer.pt"  # before the sharded format: one torch.save file per rank


class Checkpointable(Protocol):
    """A trainer that saves and restores its weights, optimizer state and step counter under one path."""

    def save(self, path: str | os.PathLike) -> None: ...

    def load(self, path: str | os.PathLike) -> None: ...


def save_checkpoint(output_dir: Path, state: RunState, trainer: Checkpointable) -> Path:
    """Write trainer, RNG states and `state` as the run's checkpoint; returns its directory."""
    current, old, tmp = checkpoint_paths(output_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    trainer.save(tmp / TRAINER_FILE)
    torch.save(capture_rng(), tmp / RNG_FILE)
    for name in (TRAINER_FILE, RNG_FILE):
        fsync_path(tmp / name)
    state.files = [TRAINER_FILE, RNG_FILE]
    write_state(tmp, state)
    fsync_path(tmp)
    if current.exists():
        if old.exists():  # left by a crash between the renames: keep whichever of the two is complete
            shutil.rmtree(old if read_state(current) is not None else current)
        if current.exists():
            os.rename(current, old)
    os.rename(tmp, current)
    fsync_path(output_dir)
    shutil.rmtree(old, ignore_errors=True)
    return current


def load_checkpoint(directory: Path, trainer: Checkpointable, restore_random: bool = True) -> RunState:
    """Restore the trainer (and the RNG states) from a checkpoint directory; returns its run state."""
    state = read_state(directory)
    if state is None:
        raise FileNotFoundError(f"{directory} holds no complete checkpoint ({directory / 'state.json'} missing)")
    trainer_path = directory / TRAINER_FILE
    if not trainer_path.exists() and (directory / LEGACY_TRAINER_FILE).exists():
        trainer_path = directory / LEGACY_TRAINER_FILE
    trainer.load(trainer_path)
    if restore_random:
        restore_rng(torch.load(directory / RNG_FILE, weights_only=True))
    return state


def capture_rng() -> dict[str, Any]:
    """Python, numpy and torch (CPU and CUDA) generator states, in types torch.load(weights_only) reads back."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": pos, "has_gauss": has_gauss, "gauss": gauss},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(saved: dict[str, Any]) -> None:
    version, internal, gauss = saved["python"]
    random.setstate((version, tuple(internal), gauss))
    n = saved["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(saved["torch"])
    if saved["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
