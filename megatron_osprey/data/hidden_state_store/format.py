"""The hidden-state store's on-disk format: names, header, shard files, size estimates.

Layout of a store directory::

    shard-{tag}-{index:06d}.safetensors   one batch of samples, written by writer `tag`
    manifest.part-{tag}.json              the shards writer `tag` has completed
    manifest.json                         merge of all parts, written by finalize_store
    .lock-{tag}                           flock held while writer `tag` runs

A shard holds concatenated per-token tensors plus per-sample offsets (see
``HiddenStateWriter._shard_tensors``); the sample ids and store header sit in the safetensors
metadata, so a shard is self-describing. A shard counts as complete only once
its writer's manifest part lists it with its sha256.

Concurrency: every writer (data-parallel rank or Slurm array task) owns a tag
and only ever creates files whose names contain that tag, so no two writers
touch the same path; an exclusive flock per tag refuses a second writer with
the same tag. manifest.json is written only by finalize_store, after all parts
say complete; it is a pure function of the parts, so two concurrent finalizes
write identical bytes through atomic renames.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open

from megatron_osprey.base.atomic_io import atomic_open
from megatron_osprey.data.hidden_state_quant import check_encoding
from megatron_osprey.data.hidden_state_store.config import HiddenStateStoreConfig  # noqa: F401  (the store's knobs)

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
PART_PREFIX = "manifest.part-"
TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
HIDDEN_NAMES = ("aux_hidden", "final_hidden")
DTYPE_CODES = {
    torch.int32: "I32",
    torch.int64: "I64",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
}


class CorruptShardError(ValueError):
    """A shard file does not match the sha256 or size its manifest records (an input error: exit 2, one line)."""


class StoreMismatchError(ValueError):
    """A store was written for a different target, config or layout than expected."""


class InsufficientDiskError(OSError):
    """Not enough free disk for the store about to be written."""


@dataclass(frozen=True)
class StoreHeader:
    """What a store holds; every shard and manifest part of one store agrees on it."""

    target_id: str
    config_hash: str
    aux_layer_ids: tuple[int, ...]
    hidden_size: int
    encoding: str = "bf16"
    outliers_per_token: int = 8  # int8 only: channels per token and layer kept in bf16
    # The rollout feature (rollout.py): > 0 in a store the rollout stage wrote, whose samples also hold their
    # verify rounds (drafted tokens per round, the target's top-k probabilities at each); 0 in any other store.
    rollout_steps: int = 0
    rollout_top_k: int = 0

    def to_json(self) -> dict:
        """Return a JSON-ready dict; the rollout fields only in a rollout store (other stores' bytes stay the same)."""
        out = asdict(self)
        out["aux_layer_ids"] = list(self.aux_layer_ids)
        if not self.rollout_steps:
            del out["rollout_steps"], out["rollout_top_k"]
        return out

    @classmethod
    def from_json(cls, data: dict) -> "StoreHeader":
        """Build from :meth:`to_json` output."""
        return cls(**{**data, "aux_layer_ids": tuple(data["aux_layer_ids"])})

    @property
    def num_aux_layers(self) -> int:
        """Number of tapped target layers concatenated in ``aux_hidden``."""
        return len(self.aux_layer_ids)


@dataclass(frozen=True)
class ShardRecord:
    """One complete shard as listed in a manifest."""

    file: str
    writer: str
    index: int
    num_samples: int
    num_tokens: int
    num_bytes: int
    sha256: str


def json_bytes(obj: dict) -> bytes:
    # Sorted keys and no timestamps: a resumed run writes byte-identical manifests.
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    t = t.detach().contiguous().cpu().reshape(-1)
    if t.dtype is not torch.int8 and t.dtype is not torch.uint8:
        t = t.view(torch.uint8)
    return memoryview(t.numpy()).cast("B")


def write_safetensors_streamed(
    path: Path, entries: Sequence[tuple[str, torch.dtype, tuple[int, ...], list]], metadata: dict[str, str]
) -> tuple[str, int]:
    """Stream tensors (each a list of pieces) into a safetensors file atomically; return (sha256, size)."""
    # Streaming piece by piece avoids holding a second, concatenated copy of a
    # multi-GB shard in memory; the layout is the standard safetensors one.
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, pieces in entries:
        nbytes = sum(_tensor_bytes(p).nbytes if isinstance(p, torch.Tensor) else len(p) for p in pieces)
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    head += b" " * (-len(head) % 8)
    digest = hashlib.sha256()
    with atomic_open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(head)), head):
            f.write(chunk)
            digest.update(chunk)
        for _, _, _, pieces in entries:
            for piece in pieces:
                chunk = _tensor_bytes(piece) if isinstance(piece, torch.Tensor) else piece
                f.write(chunk)
                digest.update(chunk)
        size = f.tell()
    return digest.hexdigest(), size


def shard_name(tag: str, index: int) -> str:
    """File name of shard ``index`` of writer ``tag``."""
    return f"shard-{tag}-{index:06d}.safetensors"


def lock_path(store_dir: Path, tag: str) -> Path:
    """The flock file writer `tag` holds while it runs."""
    return store_dir / f".lock-{tag}"


def checked_shard_file(store_dir: Path, name: str, where: Path) -> str:
    """A manifest's shard name, refused unless it is a plain file name that resolves inside the store.

    Manifests are data: a crafted `../../x` or a symlink out of the store must
    not make the reader open files elsewhere.
    """
    root = Path(store_dir).resolve()
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise StoreMismatchError(
            f"{where} names shard {name!r}, which is not a plain file name in {store_dir}; "
            f"the manifest was not written by this store's writers."
        )
    if not (root / name).resolve().is_relative_to(root):
        raise StoreMismatchError(f"{where} names shard {name!r}, which resolves outside {store_dir}; refusing it.")
    return name


def part_name(tag: str) -> str:
    """File name of writer ``tag``'s manifest part."""
    return f"{PART_PREFIX}{tag}.json"


def writer_tag(rank: int, world_size: int) -> str:
    """Default writer tag for one rank (or array task) of ``world_size``."""
    return f"rank{rank:05d}-of-{world_size:05d}"


def estimate_store_bytes(
    num_tokens: int,
    hidden_size: int,
    encoding: str,
    *,
    num_aux_layers: int = 3,
    outliers_per_token: int = 8,
    num_samples: int = 0,
) -> int:
    """Upper bound on a store's bytes (int8 assumes zstd saves nothing) for preflight checks."""
    check_encoding(encoding)
    groups = num_aux_layers + 1
    per_token = 4 + 1  # input_ids int32 + loss_mask
    per_sample = 8 + 64  # token offset + sample id in the shard header
    if encoding == "bf16":
        per_token += 2 * groups * hidden_size
    else:
        per_token += groups * (hidden_size + 4 + 4 * outliers_per_token)  # int8 + scale + (int16, bf16) outliers
        # zstd's worst case on incompressible input: frame header plus 3 bytes per 128 KiB block.
        per_token += max(1, groups * hidden_size * 3 // (128 << 10))
        per_sample += 2 * (8 + 32)
    return num_tokens * per_token + num_samples * per_sample + 4096


def check_free_disk(store_dir: str | os.PathLike, needed_bytes: int) -> int:
    """Raise InsufficientDiskError unless ``store_dir``'s filesystem has ``needed_bytes`` free; return free bytes."""
    probe = Path(store_dir).absolute()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed_bytes:
        gib = 1 << 30
        raise InsufficientDiskError(
            f"hidden-state store {store_dir} needs about {needed_bytes / gib:.2f} GiB but only "
            f"{free / gib:.2f} GiB is free on its filesystem ({probe}); free space, choose another "
            f"store directory, or use encoding='int8' (under half the bytes of bf16)."
        )
    return free


def read_shard_meta(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}
