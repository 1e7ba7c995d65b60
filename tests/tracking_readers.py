"""Read experiment-tracker output back with the trackers' own code: TensorBoard's event_processing, and
W&B's offline `.wandb` transaction log decoded with wandb's protobufs (wandb 0.31 ships no Python reader;
the file is a LevelDB-style log: a 7-byte ':W&B' header, then 32 KiB blocks of CRC-framed chunks, each
chunk `crc32c(4) length(2, little-endian) type(1)`, FULL=1 FIRST=2 MIDDLE=3 LAST=4)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7


def tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} for every scalar in the event files under logdir."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def tensorboard_tags(logdir: Path) -> dict[str, list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    return acc.Tags()


def wandb_records(path: Path) -> list[Any]:
    """Every Record in a .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    records, pending, pos = [], b"", HEADER
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            records.append(rec)
            pending = b""
    return records


def wandb_run(run_dir: Path) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """(display name, history rows, summary) of the offline run in run_dir."""
    (log,) = run_dir.glob("run-*.wandb")
    name, history, summary = "", [], {}
    for rec in wandb_records(log):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            name = rec.run.display_name
        elif kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            summary |= {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.summary.update}
    return name, history, summary


def check_step_rows_in_trackers(tb_dir: Path, wandb_dir: Path, rows: list[dict[str, Any]]) -> str:
    """Every numeric value of every step row (`rows`: metrics.jsonl's step rows) as TensorBoard's scalars under
    `tb_dir` and in the W&B offline run under `wandb_dir` hold it; returns the W&B run's name."""
    import pytest

    tb = tensorboard_scalars(tb_dir)
    (run_dir,) = wandb_dir.glob("offline-run-*")
    name, history, _ = wandb_run(run_dir)
    by_step = {h["step"]: h for h in history if "reward_mean" in h}
    for r in rows:
        for key, value in r.items():
            if key != "step" and isinstance(value, (int, float)):
                assert tb[key][r["step"]] == pytest.approx(value, rel=1e-6, abs=1e-6), key
                assert by_step[r["step"]][key] == pytest.approx(value, rel=1e-9, abs=1e-9), key
    return name
