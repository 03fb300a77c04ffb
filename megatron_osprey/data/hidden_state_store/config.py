"""The store's user-facing knobs (torch-free: recipes and `osprey plan` read them)."""

from __future__ import annotations

from dataclasses import dataclass

ENCODINGS = ("bf16", "int8")  # how hidden states are stored


@dataclass
class HiddenStateStoreConfig:
    """User-facing knobs of the store, for extraction (writer) and Stage 4 (reader)."""

    store_dir: str = ""
    encoding: str = "bf16"  # or "int8": under half the bytes, ~0.1% TTT-loss change on synthetic data
    samples_per_shard: int = 64
    outliers_per_token: int = 8
    zstd_level: int = 1  # higher levels measured no smaller on int8 hidden states, only slower
    writer_threads: int = 0
    verify_sha256: bool = True
    prefetch: int = 8
    prefetch_workers: int = 1
