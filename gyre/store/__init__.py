"""HDF5 trajectory shards: schema, atomic writer, validating reader, streaming micro-batches.

See docs/hdf5.md for the file layout.
"""

from gyre.store.packing import MicroBatch, TokenBudgetPacker, pack_by_token_budget
from gyre.store.reader import Shard, ShardRollout, read_header, read_shard
from gyre.store.schema import SCHEMA_NAME, SCHEMA_VERSION, RolloutMeta, ShardError
from gyre.store.stream import END_OF_STREAM, ExcludedShard, ShardStream, StreamIdleTimeout, mark_end_of_stream
from gyre.store.writer import ShardWriter, write_shard

__all__ = [
    "END_OF_STREAM",
    "SCHEMA_NAME",
    "SCHEMA_VERSION",
    "ExcludedShard",
    "MicroBatch",
    "RolloutMeta",
    "Shard",
    "ShardError",
    "ShardRollout",
    "ShardStream",
    "ShardWriter",
    "StreamIdleTimeout",
    "TokenBudgetPacker",
    "mark_end_of_stream",
    "pack_by_token_budget",
    "read_header",
    "read_shard",
    "write_shard",
]
