"""Stream micro-batches from a directory that rollout workers keep adding shards to.

Training runs while shards are written. Only complete shards are read: writers publish a shard by
renaming it to its final `*.h5` name (writer.py), so a half-written file is never listed. A shard
that fails validation (ShardError) is recorded in `excluded`, logged and skipped: the run goes on
and nothing from it is trained. Rollouts the shard itself marks excluded are skipped too.

The stream ends when `stop()` returns True or a file named END_OF_STREAM appears in the directory
(`mark_end_of_stream`), once every shard published before that is read. With `idle_timeout_s` it
raises StreamIdleTimeout instead of waiting forever for a producer that died.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gyre.store.packing import MicroBatch, TokenBudgetPacker
from gyre.store.reader import ShardRollout, read_shard
from gyre.store.schema import SHARD_SUFFIX, ShardError

END_OF_STREAM = "END_OF_STREAM"
log = logging.getLogger(__name__)


class StreamIdleTimeout(TimeoutError):
    pass


@dataclass(frozen=True)
class ExcludedShard:
    path: str
    reason: str


@dataclass
class StreamStats:
    shards_read: list[str] = field(default_factory=list)
    rollouts: int = 0  # trainable rollouts handed out
    rollouts_excluded: int = 0  # rollouts their shard marks excluded (failed evaluations, ...)
    tokens: int = 0
    micro_batches: int = 0


def mark_end_of_stream(directory: str | Path) -> Path:
    """Tell readers that no more shards will be published to `directory` (call after the last rename)."""
    marker = Path(directory) / END_OF_STREAM
    marker.touch()
    return marker


def list_complete_shards(directory: str | Path) -> list[Path]:
    """Published shards in name order; temp files (hidden, `.tmp`) never match."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(Path(directory) / n for n in names if n.endswith(SHARD_SUFFIX) and not n.startswith("."))


class ShardStream:
    """Iterate MicroBatch[ShardRollout] (tree tokens <= token_budget each) as shards appear."""

    def __init__(
        self,
        directory: str | Path,
        token_budget: int,
        *,
        poll_s: float = 0.5,
        idle_timeout_s: float | None = None,
        stop: Callable[[], bool] | None = None,
        on_excluded: Callable[[ExcludedShard], None] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.token_budget = token_budget
        self.poll_s = poll_s
        self.idle_timeout_s = idle_timeout_s
        self.stop = stop
        self.on_excluded = on_excluded
        self.excluded: list[ExcludedShard] = []
        self.stats = StreamStats()
        self._seen: set[Path] = set()

    def __iter__(self) -> Iterator[MicroBatch[ShardRollout]]:
        packer: TokenBudgetPacker[ShardRollout] = TokenBudgetPacker(self.token_budget)
        last_new = time.monotonic()
        while True:
            ended = self._ended()  # checked before listing: shards published before the end are listed
            new = [p for p in list_complete_shards(self.directory) if p not in self._seen]
            for path in new:
                self._seen.add(path)
                for rollout in self._trainable_rollouts(path):
                    yield from self._count(packer.add(rollout))
            if new:
                last_new = time.monotonic()
                continue
            if ended:
                yield from self._count(packer.flush())
                return
            idle = time.monotonic() - last_new
            if self.idle_timeout_s is not None and idle > self.idle_timeout_s:
                raise StreamIdleTimeout(
                    f"no new shard in {self.directory} for {idle:.0f}s and no {END_OF_STREAM} marker; "
                    "check that rollout workers are running, or raise idle_timeout_s"
                )
            time.sleep(self.poll_s)

    def _ended(self) -> bool:
        return (self.stop is not None and self.stop()) or (self.directory / END_OF_STREAM).exists()

    def _trainable_rollouts(self, path: Path) -> list[ShardRollout]:
        try:
            shard = read_shard(path)
        except (ShardError, OSError) as e:  # OSError: the file vanished or is unreadable
            reason = e.problem if isinstance(e, ShardError) else str(e)
            record = ExcludedShard(str(path), reason)
            self.excluded.append(record)
            log.warning("excluding shard %s from training: %s", path, reason)
            if self.on_excluded is not None:
                self.on_excluded(record)
            return []
        self.stats.shards_read.append(str(path))
        trainable = list(shard.trainable())
        self.stats.rollouts_excluded += shard.n_rollouts - len(trainable)
        return trainable

    def _count(self, batches: list[MicroBatch[ShardRollout]]) -> list[MicroBatch[ShardRollout]]:
        for batch in batches:
            self.stats.micro_batches += 1
            self.stats.rollouts += len(batch.items)
            self.stats.tokens += batch.n_tokens
        return batches
