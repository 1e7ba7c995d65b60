"""Writing and reading `output_dir/checkpoint/`: trainer, RNG states and the run's state, atomically.

The new checkpoint is written in full to `checkpoint.tmp/` (state.json last, every file fsynced),
then swapped in: `checkpoint/` -> `checkpoint.old/`, `checkpoint.tmp/` -> `checkpoint/`, then
`checkpoint.old/` is removed. A crash at any point leaves a complete checkpoint in `checkpoint/`
or, only between the two renames, in `checkpoint.old/`; `state.find_checkpoint` looks in that order.

`Checkpointer` takes the write off the step's critical path (as torchtitan's async checkpoint does): the
caller's thread only copies a consistent snapshot (the trainer's tensors, RNG states, run state), a
background thread writes and publishes it as above. The core cell uses it (gyre.sched.cell.worker), for every scheduler.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
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


class Snapshot(Protocol):
    """A copy of a trainer's checkpoint taken at one instant (MegatronTrainer.snapshot), written later."""

    def write(self, path: str | os.PathLike) -> None: ...


def save_checkpoint(output_dir: Path, state: RunState, trainer: Checkpointable) -> Path:
    """Write trainer, RNG states and `state` as the run's checkpoint, in the caller; returns its directory."""
    return publish_checkpoint(output_dir, state, capture_rng(), trainer.save)


def publish_checkpoint(
    output_dir: Path, state: RunState, rng: dict[str, Any], write_trainer: Callable[[Path], None]
) -> Path:
    """Write a checkpoint into checkpoint.tmp/ (state.json last) and swap it in; returns its directory."""
    current, old, tmp = checkpoint_paths(output_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_trainer(tmp / TRAINER_FILE)
    torch.save(rng, tmp / RNG_FILE)
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


class BackgroundWriter:
    """One write at a time on a thread of its own: `submit` waits for the write before it, and a write's error is
    raised by the next submit, wait or close."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyre-checkpoint")
        self._pending: Future[Any] | None = None

    def submit(self, write: Callable[..., Any], *args: Any) -> None:
        self.wait()
        self._pending = self._pool.submit(write, *args)

    def wait(self) -> Any:
        """Until the write in flight is done; returns its result (None: nothing in flight)."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)


class Checkpointer:
    """The run's checkpoints, off the step's critical path. `save` copies what the checkpoint holds on the caller's
    thread, a consistent snapshot of the completed steps (trainer tensors, RNG states, run state), and a background
    thread writes and publishes it (publish_checkpoint: the run only ever points at a complete one). At most one
    write is in flight: the next save waits for it, and a write's error is raised by the next save, wait or close.
    Written in the caller instead: asynchronous=False, or a trainer whose `snapshot` gives None (megatron's CUDA
    optimizer)."""

    def __init__(self, output_dir: Path, asynchronous: bool = True) -> None:
        self.output_dir = output_dir
        self.asynchronous = asynchronous
        self.saved_step: int | None = None  # next_step of the last checkpoint asked for
        self.blocking_s = 0.0  # the last save's time on the caller's thread
        self.writer = BackgroundWriter()

    def save(self, state: RunState, trainer: Checkpointable) -> None:
        start = time.perf_counter()
        self.writer.wait()
        snapshot: Snapshot | None = getattr(trainer, "snapshot", lambda: None)() if self.asynchronous else None
        frozen, rng = RunState.from_json(state.to_json()), capture_rng()
        if snapshot is None:
            publish_checkpoint(self.output_dir, frozen, rng, trainer.save)
        else:
            self.writer.submit(publish_checkpoint, self.output_dir, frozen, rng, snapshot.write)
        self.saved_step = state.next_step
        self.blocking_s = time.perf_counter() - start

    def save_final(self, state: RunState, trainer: Checkpointable) -> None:
        """The checkpoint of `state` complete on disk when this returns (a stop, the run's end): the write in
        flight finishes, and `state` is saved if it is not the one that write holds."""
        self.writer.wait()
        if self.saved_step != state.next_step:
            self.save(state, trainer)
            self.writer.wait()

    def wait(self) -> Path | None:
        """Until the checkpoint in flight is published; returns its directory (None: nothing in flight)."""
        return self.writer.wait()

    def close(self) -> None:
        self.writer.close()


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
