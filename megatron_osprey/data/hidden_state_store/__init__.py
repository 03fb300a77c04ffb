"""Sharded on-disk store of target hidden states for offline distillation (Stage 4).

format: names, header and shard files (the directory layout and the concurrency rules
are stated there); writer: one writer's shards and manifest part, resumable; manifest:
the parts merged into manifest.json; reader: random access and prefetching iteration; rollout: the
optional verify rounds of a rollout store (Draft-OPD).
"""

from importlib import import_module

from megatron_osprey.base.checksums import file_sha256 as file_sha256
from megatron_osprey.data.hidden_state_store.config import HiddenStateStoreConfig as HiddenStateStoreConfig

# The other names load torch with their module, so that the config above imports without it.
_LAZY = {
    "format": (
        "FORMAT_VERSION",
        "MANIFEST_NAME",
        "CorruptShardError",
        "InsufficientDiskError",
        "ShardRecord",
        "StoreHeader",
        "StoreMismatchError",
        "check_free_disk",
        "estimate_store_bytes",
        "lock_path",
        "part_name",
        "shard_name",
        "writer_tag",
    ),
    "manifest": ("finalize_store",),
    "reader": ("HiddenStateStore", "open_store"),
    "rollout": ("RolloutRounds",),
    "writer": ("HiddenStateWriter", "open_writer"),
}
_HOME = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str):
    if name in _HOME:
        return getattr(import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(["HiddenStateStoreConfig", "file_sha256", *_HOME])
