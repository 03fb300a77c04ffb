"""Sharded on-disk store of target hidden states for offline distillation (Stage 4).

format: names, header and shard files (the directory layout and the concurrency rules
are stated there); writer: one writer's shards and manifest part, resumable; manifest:
the parts merged into manifest.json; reader: random access and prefetching iteration.
"""

from megatron_osprey.base.checksums import file_sha256
from megatron_osprey.data.hidden_state_store.format import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    CorruptShardError,
    HiddenStateStoreConfig,
    InsufficientDiskError,
    ShardRecord,
    StoreHeader,
    StoreMismatchError,
    check_free_disk,
    estimate_store_bytes,
    lock_path,
    part_name,
    shard_name,
    writer_tag,
)
from megatron_osprey.data.hidden_state_store.manifest import finalize_store
from megatron_osprey.data.hidden_state_store.reader import HiddenStateStore, open_store
from megatron_osprey.data.hidden_state_store.writer import HiddenStateWriter, open_writer

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "CorruptShardError",
    "HiddenStateStore",
    "HiddenStateStoreConfig",
    "HiddenStateWriter",
    "InsufficientDiskError",
    "ShardRecord",
    "StoreHeader",
    "StoreMismatchError",
    "check_free_disk",
    "estimate_store_bytes",
    "file_sha256",
    "lock_path",
    "finalize_store",
    "open_store",
    "open_writer",
    "part_name",
    "shard_name",
    "writer_tag",
]
