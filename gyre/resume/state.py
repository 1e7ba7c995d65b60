"""The bookkeeping of a run that a checkpoint carries: position, weight version, ledger, starts.

`state.json` is the last file written into a checkpoint directory, so its presence (and the
presence of every file it lists) is what makes a checkpoint complete. No torch here.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"
CHECKPOINT_DIR = "checkpoint"
FORMAT_VERSION = 1
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID")


@dataclass
class StepRecord:
    """One completed step: the rollouts its shards hold and those that entered its optimizer update."""

    step: int
    rollouts: list[str]  # every rollout id stored in the step's shards
    trained: list[str]  # those whose trees were trained (non-zero advantage)
    shards: list[str]  # shard file names under output_dir/shards
    weight_version: int  # the version this step's update produced
    start: int  # index into RunState.starts: which start of the job trained it
    rejected: list[str] = field(default_factory=list)  # finished but not stored (call log rejected; in metrics)


@dataclass
class RunState:
    next_step: int = 0  # steps 0..next_step-1 are completed (trained, recorded in the ledger)
    weight_version: int = 0  # the version of the trainer's weights (0: the warm start)
    ledger: list[StepRecord] = field(default_factory=list)
    starts: list[dict[str, Any]] = field(default_factory=list)  # one per start of the job (fresh or resumed)
    data: dict[str, Any] = field(default_factory=dict)  # task-pool position (derivable from next_step)
    files: list[str] = field(default_factory=list)  # the checkpoint's files besides state.json

    def begin(self, env: Mapping[str, str] = os.environ) -> dict[str, Any]:
        """Record this start of the job (Slurm job id and restart count when under Slurm)."""
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "from_step": self.next_step,
            **{k.lower(): env[k] for k in SLURM_VARS if k in env},
        }
        self.starts.append(entry)
        return entry

    def record_step(
        self, step: int, rollouts: list[str], trained: list[str], shards: list[str], rejected: Sequence[str] = ()
    ) -> StepRecord:
        """Mark `step` completed; it must be the next one (a step trained twice or skipped is a bug)."""
        if step != self.next_step:
            raise RuntimeError(f"step {step} completed but the run expected step {self.next_step}: refusing to record")
        if len(set(rollouts)) != len(rollouts):
            raise RuntimeError(f"step {step} stored a rollout id twice: {sorted(rollouts)}")
        record = StepRecord(
            step, sorted(rollouts), sorted(trained), sorted(shards), step + 1, len(self.starts) - 1, sorted(rejected)
        )
        self.ledger.append(record)
        self.next_step, self.weight_version = step + 1, record.weight_version
        return record

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, blob: Mapping[str, Any]) -> RunState:
        if blob.get("format") != FORMAT_VERSION:
            raise ValueError(f"checkpoint state format {blob.get('format')!r}; this gyre reads {FORMAT_VERSION}")
        fields = {k: v for k, v in blob.items() if k != "format"}
        fields["ledger"] = [StepRecord(**r) for r in fields.get("ledger", [])]
        return cls(**fields)


def write_state(directory: Path, state: RunState) -> None:
    """state.json, fsynced: written last into a checkpoint directory."""
    path = directory / STATE_FILE
    with path.open("w") as f:
        json.dump(state.to_json(), f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_state(directory: Path) -> RunState | None:
    """The state of a complete checkpoint directory; None when it is missing or partial.

    A state.json of another format raises (ValueError): resuming must not silently start over."""
    try:
        blob = json.loads((directory / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    state = RunState.from_json(blob)
    return state if all((directory / name).exists() for name in state.files) else None


def checkpoint_paths(output_dir: Path) -> tuple[Path, Path, Path]:
    """(current, old, tmp) checkpoint directories of a run."""
    current = output_dir / CHECKPOINT_DIR
    return current, current.with_name(CHECKPOINT_DIR + ".old"), current.with_name(CHECKPOINT_DIR + ".tmp")


def find_checkpoint(output_dir: Path) -> Path | None:
    """The complete checkpoint directory of a run, if it has one."""
    current, old, _ = checkpoint_paths(output_dir)
    for directory in (current, old):
        if read_state(directory) is not None:
            return directory
    return None
