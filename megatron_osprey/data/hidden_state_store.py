"""Sharded on-disk store of target hidden states for offline distillation (Stage 4).

Layout of a store directory::

    shard-{tag}-{index:06d}.safetensors   one batch of samples, written by writer `tag`
    manifest.part-{tag}.json              the shards writer `tag` has completed
    manifest.json                         merge of all parts, written by finalize_store
    .lock-{tag}                           flock held while writer `tag` runs

A shard holds concatenated per-token tensors plus per-sample offsets (see
``_shard_tensors``); the sample ids and store header sit in the safetensors
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

import bisect
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import struct
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch
from safetensors import safe_open

from megatron_osprey.data.hidden_state_quant import (
    Int8Encoded,
    check_encoding,
    compress_int8,
    decompress_int8,
    dequantize_int8,
    quantize_int8,
)

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
_PART_PREFIX = "manifest.part-"
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_HIDDEN_NAMES = ("aux_hidden", "final_hidden")
_DTYPE_CODES = {
    torch.int32: "I32",
    torch.int64: "I64",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
}
_COPY_CHUNK = 16 << 20


class CorruptShardError(RuntimeError):
    """A shard file does not match the sha256 or size its manifest records."""


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

    def to_json(self) -> dict:
        """Return a JSON-ready dict."""
        out = asdict(self)
        out["aux_layer_ids"] = list(self.aux_layer_ids)
        return out

    @classmethod
    def from_json(cls, data: dict) -> "StoreHeader":
        """Build from :meth:`to_json` output."""
        return cls(**{**data, "aux_layer_ids": tuple(data["aux_layer_ids"])})

    @property
    def num_aux_layers(self) -> int:
        """Number of tapped target layers concatenated in ``aux_hidden``."""
        return len(self.aux_layer_ids)


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


# ---------------------------------------------------------------- file helpers


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_name(final: Path) -> Path:
    return final.with_name(f".tmp-{final.name}.{os.getpid()}.{threading.get_ident()}")


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _json_bytes(obj: dict) -> bytes:
    # Sorted keys and no timestamps: a resumed run writes byte-identical manifests.
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _to_cpu(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    t = t.detach().contiguous().cpu().reshape(-1)
    if t.dtype is not torch.int8 and t.dtype is not torch.uint8:
        t = t.view(torch.uint8)
    return memoryview(t.numpy()).cast("B")


def _write_safetensors(path: Path, entries: Sequence[tuple[str, torch.dtype, tuple[int, ...], list]],
                       metadata: dict[str, str]) -> tuple[str, int]:
    """Stream tensors (each a list of pieces) into a safetensors file atomically; return (sha256, size)."""
    # Streaming piece by piece avoids holding a second, concatenated copy of a
    # multi-GB shard in memory; the layout is the standard safetensors one.
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, pieces in entries:
        nbytes = sum(_tensor_bytes(p).nbytes if isinstance(p, torch.Tensor) else len(p) for p in pieces)
        header[name] = {"dtype": _DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    head += b" " * (-len(head) % 8)
    digest = hashlib.sha256()
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            for chunk in (struct.pack("<Q", len(head)), head):
                f.write(chunk)
                digest.update(chunk)
            for _, _, _, pieces in entries:
                for piece in pieces:
                    chunk = _tensor_bytes(piece) if isinstance(piece, torch.Tensor) else piece
                    f.write(chunk)
                    digest.update(chunk)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return digest.hexdigest(), size


def file_sha256(path: str | os.PathLike) -> str:
    """Return the hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def shard_name(tag: str, index: int) -> str:
    """File name of shard ``index`` of writer ``tag``."""
    return f"shard-{tag}-{index:06d}.safetensors"


def lock_path(store_dir: Path, tag: str) -> Path:
    """The flock file writer `tag` holds while it runs."""
    return store_dir / f".lock-{tag}"


def part_name(tag: str) -> str:
    """File name of writer ``tag``'s manifest part."""
    return f"{_PART_PREFIX}{tag}.json"


def writer_tag(rank: int, world_size: int) -> str:
    """Default writer tag for one rank (or array task) of ``world_size``."""
    return f"rank{rank:05d}-of-{world_size:05d}"


# ---------------------------------------------------------------- disk preflight


def estimate_store_bytes(num_tokens: int, hidden_size: int, encoding: str, *, num_aux_layers: int = 3,
                         outliers_per_token: int = 8, num_samples: int = 0) -> int:
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
    """Raise InsufficientDiskError unless the filesystem of ``store_dir`` has ``needed_bytes`` free; return free bytes."""
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


# ---------------------------------------------------------------- manifests


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); it was not written by this store's writers, "
                         f"which write manifests atomically.") from exc


def _check_header(found: StoreHeader, expected: StoreHeader, where: Path) -> None:
    if found != expected:
        diffs = [f"{k}: {getattr(found, k)!r} != {getattr(expected, k)!r}"
                 for k in expected.__dataclass_fields__ if getattr(found, k) != getattr(expected, k)]
        raise StoreMismatchError(
            f"{where} was written with a different store header ({'; '.join(diffs)}); "
            f"use a new store directory or the original settings."
        )


def _checked_shard_file(store_dir: Path, name: str, where: Path) -> str:
    """A manifest's shard name, refused unless it is a plain file name that resolves inside the store.

    Manifests are data: a crafted `../../x` or a symlink out of the store must
    not make the reader open files elsewhere.
    """
    root = store_dir.resolve()
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise StoreMismatchError(f"{where} names shard {name!r}, which is not a plain file name in {store_dir}; "
                                 f"the manifest was not written by this store's writers.")
    if not (root / name).resolve().is_relative_to(root):
        raise StoreMismatchError(f"{where} names shard {name!r}, which resolves outside {store_dir}; refusing it.")
    return name


def _read_shard_meta(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


# ---------------------------------------------------------------- writer


@dataclass
class _EncodedSample:
    sample_id: str
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # bool [T]
    hidden: dict  # name -> bf16 tensor, or name -> (Int8Encoded without q, zstd frame or its Future)


class HiddenStateWriter:
    """Writes one writer's shards and manifest part; resumable after a crash or requeue."""

    def __init__(
        self,
        store_dir: str | os.PathLike,
        *,
        target_id: str,
        config_hash: str,
        aux_layer_ids: Sequence[int],
        hidden_size: int,
        encoding: str = "bf16",
        samples_per_shard: int = 64,
        rank: int = 0,
        world_size: int = 1,
        tag: str | None = None,
        outliers_per_token: int = 8,
        zstd_level: int = 1,
        threads: int = 0,
    ) -> None:
        check_encoding(encoding)
        if threads < 0:
            raise ValueError(f"threads must be >= 0, got {threads}.")
        if samples_per_shard < 1:
            raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}.")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}.")
        if hidden_size < 1 or not aux_layer_ids:
            raise ValueError("hidden_size must be >= 1 and aux_layer_ids must name at least one layer.")
        self.header = StoreHeader(
            target_id=str(target_id),
            config_hash=str(config_hash),
            aux_layer_ids=tuple(int(i) for i in aux_layer_ids),
            hidden_size=int(hidden_size),
            encoding=encoding,
            outliers_per_token=int(outliers_per_token) if encoding == "int8" else 0,
        )
        if encoding == "int8" and not 0 <= outliers_per_token < hidden_size:
            raise ValueError(f"outliers_per_token must be in [0, hidden_size), got {outliers_per_token}.")
        self.tag = tag if tag is not None else writer_tag(rank, world_size)
        if not _TAG_RE.match(self.tag):
            raise ValueError(f"writer tag {self.tag!r} must match {_TAG_RE.pattern}.")
        self.store_dir = Path(store_dir)
        self.rank, self.world_size = rank, world_size
        self.samples_per_shard = samples_per_shard
        self.zstd_level = zstd_level
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._acquire_lock()
        try:
            self._shards = self._load_part()
            self._check_other_headers()
            self._remove_strays()
            self._done_ids = self._load_completed_ids()
        except BaseException:
            self._release_lock()
            raise
        self._pending: list[_EncodedSample] = []
        self._seen_ids = set(self._done_ids)
        self._next_index = len(self._shards)
        self._closed = False
        # threads > 0: zstd runs on a pool and shards are written by one
        # background thread, so the extraction loop only pays for device work.
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"hss-encode-{self.tag}") if threads else None
        self._io = ThreadPoolExecutor(1, thread_name_prefix=f"hss-write-{self.tag}") if threads else None
        self._inflight: Future | None = None

    # -- resume state

    @property
    def completed_shards(self) -> list[ShardRecord]:
        """Shards this writer has completed (listed in its manifest part)."""
        self._wait_inflight()
        return list(self._shards)

    def completed_sample_ids(self) -> set[str]:
        """Sample ids already in complete shards; the extractor skips these."""
        self._wait_inflight()
        return set(self._done_ids)

    @property
    def num_completed_samples(self) -> int:
        """Number of samples in complete shards."""
        return sum(s.num_samples for s in self.completed_shards)

    # -- writing

    def add(self, sample_id: str, input_ids: torch.Tensor, loss_mask: torch.Tensor,
            aux_hidden: torch.Tensor, final_hidden: torch.Tensor) -> None:
        """Queue one sample; a full shard is written to disk and recorded."""
        if self._closed:
            raise RuntimeError(f"writer {self.tag} is closed.")
        sample_id = str(sample_id)
        if sample_id in self._seen_ids:
            raise ValueError(f"sample id {sample_id!r} was already written by writer {self.tag}.")
        self._pending.append(self._encode(sample_id, input_ids, loss_mask, aux_hidden, final_hidden))
        self._seen_ids.add(sample_id)
        if len(self._pending) == self.samples_per_shard:
            self._flush(complete=False)

    def add_batch(self, sample_ids: Sequence[str], input_ids: torch.Tensor, loss_mask: torch.Tensor,
                  aux_hidden: torch.Tensor, final_hidden: torch.Tensor, lengths: Sequence[int]) -> None:
        """Add the rows of a right-padded batch ([B, S, ...]), row b cut to its first lengths[b] tokens."""
        if not len(sample_ids) == len(lengths) == input_ids.shape[0]:
            raise ValueError(f"add_batch got {len(sample_ids)} sample ids, {len(lengths)} lengths and "
                             f"{input_ids.shape[0]} rows; they must match.")
        for b, (sample_id, n) in enumerate(zip(sample_ids, lengths)):
            n = int(n)
            self.add(sample_id, input_ids[b, :n], loss_mask[b, :n], aux_hidden[b, :n], final_hidden[b, :n])

    def close(self) -> None:
        """Write the last (possibly short) shard, mark this writer complete and release its lock."""
        if self._closed:
            return
        try:
            if self._pending:
                self._flush(complete=True)
            else:
                self._wait_inflight()
                self._write_part(complete=True)
            self._wait_inflight()
        finally:
            self._closed = True
            self._shutdown_threads()
            self._release_lock()

    def abandon(self) -> None:
        """Drop queued samples without writing them and release the lock (what a crash leaves)."""
        self._pending.clear()
        self._closed = True
        # A shard write already under way finishes first, so no thread of this
        # writer touches the store after the lock is released.
        self._shutdown_threads()
        self._release_lock()

    def __enter__(self) -> "HiddenStateWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # On an exception the queued samples are dropped, not flushed as a short
        # shard: the resumed run then cuts shards exactly where a clean run would.
        if exc_type is None:
            self.close()
        else:
            self.abandon()

    # -- internals

    def _acquire_lock(self) -> int:
        path = lock_path(self.store_dir, self.tag)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RuntimeError(
                    f"another process is writing {self.store_dir} as writer {self.tag!r} (lock {path}); "
                    f"give each rank or array task its own rank/tag."
                ) from exc
            raise
        return fd

    def _shutdown_threads(self) -> None:
        for pool in (self._pool, self._io):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._pool = self._io = None

    def _wait_inflight(self) -> None:
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            inflight.result()  # re-raises a failed background write here

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def _part_path(self) -> Path:
        return self.store_dir / part_name(self.tag)

    def _load_part(self) -> list[ShardRecord]:
        path = self._part_path()
        if not path.exists():
            return []
        part = _read_json(path)
        if part.get("format_version") != FORMAT_VERSION:
            raise StoreMismatchError(f"{path} has format version {part.get('format_version')}, expected {FORMAT_VERSION}.")
        _check_header(StoreHeader.from_json(part["store"]), self.header, path)
        w = part["writer"]
        if (w["samples_per_shard"], w["rank"], w["world_size"]) != (self.samples_per_shard, self.rank, self.world_size):
            raise StoreMismatchError(
                f"{path} was written with samples_per_shard={w['samples_per_shard']}, rank={w['rank']}, "
                f"world_size={w['world_size']}; resume with the same values or use a new store directory."
            )
        shards = [ShardRecord(**s) for s in part["shards"]]
        for i, s in enumerate(shards):
            f = self.store_dir / s.file
            if s.index != i or s.file != shard_name(self.tag, i):
                raise StoreMismatchError(f"{path} lists shard {s.file} at position {i}; the part file was edited.")
            if not f.exists() or f.stat().st_size != s.num_bytes:
                raise CorruptShardError(
                    f"{f} is listed complete in {path} but is missing or has the wrong size; "
                    f"delete {path} and that writer's shards to re-extract them."
                )
        return shards

    def _check_other_headers(self) -> None:
        # Catch mixing targets in one directory before writing anything.
        others = [p for p in self.store_dir.glob(f"{_PART_PREFIX}*.json") if p != self._part_path()]
        merged = self.store_dir / MANIFEST_NAME
        for p in others + ([merged] if merged.exists() else []):
            _check_header(StoreHeader.from_json(_read_json(p)["store"]), self.header, p)

    def _remove_strays(self) -> None:
        # Unlisted shards of this tag are partial by definition; temp files are leftovers of a kill.
        # Exact patterns, not globs: tag "a" must never match tag "a-b"'s files.
        listed = {s.file for s in self._shards}
        tag = re.escape(self.tag)
        shard_re = re.compile(rf"shard-{tag}-\d{{6}}\.safetensors")
        tmp_re = re.compile(rf"\.tmp-(shard-{tag}-\d{{6}}\.safetensors|{re.escape(part_name(self.tag))})\.\d+\.\d+")
        for p in self.store_dir.iterdir():
            if (shard_re.fullmatch(p.name) and p.name not in listed) or tmp_re.fullmatch(p.name):
                p.unlink()

    def _load_completed_ids(self) -> set[str]:
        ids: set[str] = set()
        for s in self._shards:
            ids.update(json.loads(_read_shard_meta(self.store_dir / s.file)["sample_ids"]))
        return ids

    def _encode(self, sample_id, input_ids, loss_mask, aux_hidden, final_hidden) -> _EncodedSample:
        h = self.header
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(f"sample {sample_id!r}: input_ids must be a non-empty 1-D tensor, got {tuple(input_ids.shape)}.")
        t = input_ids.shape[0]
        expect = {"loss_mask": (t,), "aux_hidden": (t, h.num_aux_layers * h.hidden_size), "final_hidden": (t, h.hidden_size)}
        for name, tensor in (("loss_mask", loss_mask), ("aux_hidden", aux_hidden), ("final_hidden", final_hidden)):
            if tuple(tensor.shape) != expect[name]:
                raise ValueError(f"sample {sample_id!r}: {name} has shape {tuple(tensor.shape)}, expected {expect[name]}.")
        for name, tensor in (("aux_hidden", aux_hidden), ("final_hidden", final_hidden)):
            # One reduction instead of an elementwise mask: NaN and inf both survive a sum.
            if not tensor.is_floating_point() or not bool(torch.isfinite(tensor.sum(dtype=torch.float32))):
                raise ValueError(f"sample {sample_id!r}: {name} must be floating point and finite.")
        if input_ids.min() < 0 or input_ids.max() > torch.iinfo(torch.int32).max:
            raise ValueError(f"sample {sample_id!r}: input_ids must be in [0, 2^31).")
        # copy=True everywhere: the caller may reuse its buffers while this sample waits for its shard.
        hidden: dict = {}
        for name, tensor, groups in (("aux_hidden", aux_hidden, h.num_aux_layers), ("final_hidden", final_hidden, 1)):
            if h.encoding == "bf16":
                hidden[name] = _to_cpu(tensor, torch.bfloat16)
                continue
            # Quantize where the tensor lives (GPU in extraction) so only int8 crosses PCIe.
            enc = quantize_int8(tensor, groups, h.outliers_per_token)
            q = _to_cpu(enc.q, torch.int8)
            frame = (self._pool.submit(compress_int8, q, self.zstd_level) if self._pool is not None
                     else compress_int8(q, self.zstd_level))
            meta = Int8Encoded(q=torch.empty(0, dtype=torch.int8), scale=_to_cpu(enc.scale, torch.float32),
                               outlier_index=_to_cpu(enc.outlier_index, torch.int16),
                               outlier_value=_to_cpu(enc.outlier_value, torch.bfloat16))
            hidden[name] = (meta, frame)
        return _EncodedSample(sample_id, _to_cpu(input_ids, torch.int32), _to_cpu(loss_mask, torch.bool), hidden)

    def _shard_tensors(self, samples: list[_EncodedSample]) -> list[tuple[str, torch.dtype, tuple[int, ...], list]]:
        h = self.header
        lengths = [s.input_ids.shape[0] for s in samples]
        ntok = sum(lengths)
        token_offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        entries = [
            ("token_offsets", torch.int64, (len(samples) + 1,), [token_offsets]),
            ("input_ids", torch.int32, (ntok,), [s.input_ids for s in samples]),
            ("loss_mask", torch.bool, (ntok,), [s.loss_mask for s in samples]),
        ]
        for name, groups in (("aux_hidden", h.num_aux_layers), ("final_hidden", 1)):
            width = groups * h.hidden_size
            if h.encoding == "bf16":
                entries.append((name, torch.bfloat16, (ntok, width), [s.hidden[name] for s in samples]))
                continue
            frames = [f.result() if isinstance(f, Future) else f for f in (s.hidden[name][1] for s in samples)]
            encs = [s.hidden[name][0] for s in samples]
            k = h.outliers_per_token
            frame_offsets = torch.tensor([0] + [len(f) for f in frames], dtype=torch.int64).cumsum(0)
            entries += [
                (f"{name}.zstd", torch.uint8, (int(frame_offsets[-1]),), frames),
                (f"{name}.zstd_offsets", torch.int64, (len(samples) + 1,), [frame_offsets]),
                (f"{name}.scale", torch.float32, (ntok, groups), [e.scale for e in encs]),
                (f"{name}.outlier_index", torch.int16, (ntok, groups, k), [e.outlier_index for e in encs]),
                (f"{name}.outlier_value", torch.bfloat16, (ntok, groups, k), [e.outlier_value for e in encs]),
            ]
        return entries

    def _flush(self, complete: bool) -> None:
        samples, self._pending = self._pending, []
        index, self._next_index = self._next_index, self._next_index + 1
        if self._io is None:
            self._write_shard(samples, index, complete)
            return
        # At most one shard in flight bounds memory to two shards.
        self._wait_inflight()
        self._inflight = self._io.submit(self._write_shard, samples, index, complete)

    def _write_shard(self, samples: list[_EncodedSample], index: int, complete: bool) -> None:
        name = shard_name(self.tag, index)
        metadata = {
            "format_version": str(FORMAT_VERSION),
            "store": json.dumps(self.header.to_json(), sort_keys=True),
            "sample_ids": json.dumps([s.sample_id for s in samples]),
        }
        sha, size = _write_safetensors(self.store_dir / name, self._shard_tensors(samples), metadata)
        self._shards.append(ShardRecord(
            file=name, writer=self.tag, index=index, num_samples=len(samples),
            num_tokens=sum(s.input_ids.shape[0] for s in samples), num_bytes=size, sha256=sha,
        ))
        # The part is rewritten after the shard is durable: a crash in between
        # leaves an unlisted (hence partial) shard that the next run rewrites.
        self._write_part(complete=complete)
        self._done_ids.update(s.sample_id for s in samples)

    def _write_part(self, complete: bool) -> None:
        part = {
            "format_version": FORMAT_VERSION,
            "store": self.header.to_json(),
            "writer": {"tag": self.tag, "rank": self.rank, "world_size": self.world_size,
                       "samples_per_shard": self.samples_per_shard},
            "complete": complete,
            "shards": [asdict(s) for s in self._shards],
        }
        _atomic_write_bytes(self._part_path(), _json_bytes(part))


# ---------------------------------------------------------------- finalize


def finalize_store(store_dir: str | os.PathLike, *, require_complete: bool = True) -> Path:
    """Merge every writer's manifest part into manifest.json (run once all writers are done)."""
    store_dir = Path(store_dir)
    parts = sorted(store_dir.glob(f"{_PART_PREFIX}*.json"))
    if not parts:
        raise FileNotFoundError(f"no {_PART_PREFIX}*.json in {store_dir}; run the extraction before finalizing.")
    loaded = [(p, _read_json(p)) for p in parts]
    header = StoreHeader.from_json(loaded[0][1]["store"])
    world_sizes = set()
    ranks = set()
    for p, part in loaded:
        if part.get("format_version") != FORMAT_VERSION:
            raise StoreMismatchError(f"{p} has format version {part.get('format_version')}, expected {FORMAT_VERSION}.")
        _check_header(StoreHeader.from_json(part["store"]), header, p)
        if require_complete and not part["complete"]:
            raise RuntimeError(f"{p} is not complete: writer {part['writer']['tag']!r} has not finished; "
                               f"rerun it (it resumes) before finalizing.")
        world_sizes.add(part["writer"]["world_size"])
        ranks.add(part["writer"]["rank"])
    if require_complete:
        if len(world_sizes) != 1:
            raise StoreMismatchError(f"manifest parts in {store_dir} disagree on world_size: {sorted(world_sizes)}.")
        missing = sorted(set(range(world_sizes.pop())) - ranks)
        if missing:
            raise RuntimeError(f"{store_dir} has no manifest part from ranks {missing}; run those writers before finalizing.")
    shards: list[ShardRecord] = []
    seen_ids: dict[str, str] = {}
    for p, part in sorted(loaded, key=lambda item: (item[1]["writer"]["rank"], item[1]["writer"]["tag"])):
        for s in (ShardRecord(**s) for s in part["shards"]):
            f = store_dir / _checked_shard_file(store_dir, s.file, p)
            if not f.exists() or f.stat().st_size != s.num_bytes:
                raise CorruptShardError(f"{f} (listed in {p.name}) is missing or has the wrong size.")
            for sid in json.loads(_read_shard_meta(f)["sample_ids"]):
                if sid in seen_ids:
                    raise StoreMismatchError(f"sample id {sid!r} is in both {seen_ids[sid]} and {s.file}; "
                                             f"writers must extract disjoint samples.")
                seen_ids[sid] = s.file
            shards.append(s)
    num_tokens = sum(s.num_tokens for s in shards)
    num_bytes = sum(s.num_bytes for s in shards)
    manifest = {
        "format_version": FORMAT_VERSION,
        "store": header.to_json(),
        "num_samples": sum(s.num_samples for s in shards),
        "num_tokens": num_tokens,
        "num_bytes": num_bytes,
        "bytes_per_token": num_bytes / num_tokens if num_tokens else 0.0,
        "writers": sorted({s.writer for s in shards}),
        "shards": [asdict(s) for s in shards],
    }
    path = store_dir / MANIFEST_NAME
    _atomic_write_bytes(path, _json_bytes(manifest))
    return path


# ---------------------------------------------------------------- reader


class _OpenShard:
    def __init__(self, path: Path, header: StoreHeader) -> None:
        self.handle = safe_open(str(path), framework="pt")
        self.token_offsets = self.handle.get_tensor("token_offsets").tolist()
        self.sample_ids = json.loads(self.handle.metadata()["sample_ids"])
        self.frame_offsets = {}
        if header.encoding == "int8":
            for name in _HIDDEN_NAMES:
                self.frame_offsets[name] = self.handle.get_tensor(f"{name}.zstd_offsets").tolist()


class HiddenStateStore:
    """Random-access reader of a finalized hidden-state store, with optional prefetching iteration."""

    def __init__(
        self,
        store_dir: str | os.PathLike,
        *,
        target_id: str | None = None,
        config_hash: str | None = None,
        aux_layer_ids: Sequence[int] | None = None,
        hidden_size: int | None = None,
        verify_sha256: bool = True,
        dtype: torch.dtype = torch.bfloat16,
        dequantize: bool = True,
        max_open_shards: int = 64,
    ) -> None:
        self.store_dir = Path(store_dir)
        path = self.store_dir / MANIFEST_NAME
        if not path.exists():
            hint = (" It has manifest parts: call finalize_store on it once every writer is done."
                    if list(self.store_dir.glob(f"{_PART_PREFIX}*.json")) else "")
            raise FileNotFoundError(f"{path} does not exist, so {self.store_dir} is not a finished hidden-state store.{hint}")
        self.manifest = _read_json(path)
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise StoreMismatchError(f"{path} has format version {self.manifest.get('format_version')}; "
                                     f"this code reads version {FORMAT_VERSION}.")
        self.header = StoreHeader.from_json(self.manifest["store"])
        expected = {"target_id": target_id, "config_hash": config_hash,
                    "aux_layer_ids": None if aux_layer_ids is None else tuple(aux_layer_ids), "hidden_size": hidden_size}
        wrong = [f"{k} is {getattr(self.header, k)!r}, expected {v!r}"
                 for k, v in expected.items() if v is not None and getattr(self.header, k) != v]
        if wrong:
            raise StoreMismatchError(f"hidden-state store {self.store_dir} does not match this run: {'; '.join(wrong)}. "
                                     f"Re-extract hidden states for this target or point to the right store.")
        self.shards = [ShardRecord(**s) for s in self.manifest["shards"]]
        for rec in self.shards:
            _checked_shard_file(self.store_dir, rec.file, path)
        self._starts = [0]
        for s in self.shards:
            self._starts.append(self._starts[-1] + s.num_samples)
        self.verify_sha256 = verify_sha256
        self.dtype = dtype
        self.dequantize = dequantize
        self._max_open = max_open_shards
        self._open: OrderedDict[int, _OpenShard] = OrderedDict()
        self._verified: set[int] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._starts[-1]

    def __getstate__(self) -> dict:
        # Picklable for DataLoader worker processes: open handles and the lock stay behind.
        state = dict(self.__dict__)
        state["_open"], state["_lock"] = OrderedDict(), None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def num_tokens(self) -> int:
        """Total tokens in the store."""
        return int(self.manifest["num_tokens"])

    def lengths(self) -> list[int]:
        """Token count of every sample, in store order (reads shard headers only), for length-aware batching."""
        out: list[int] = []
        for rec in self.shards:
            with safe_open(str(self.store_dir / rec.file), framework="pt") as f:
                offsets = f.get_tensor("token_offsets")
            out += (offsets[1:] - offsets[:-1]).tolist()
        return out

    def _verify(self, s: int) -> None:
        # Hashing runs outside the reader lock so other prefetch workers keep going.
        with self._lock:
            if not self.verify_sha256 or s in self._verified:
                return
        rec = self.shards[s]
        path = self.store_dir / rec.file
        if not path.exists() or path.stat().st_size != rec.num_bytes:
            raise CorruptShardError(f"shard {path} is missing or its size differs from the manifest; re-extract it.")
        if file_sha256(path) != rec.sha256:
            raise CorruptShardError(f"shard {path} fails its sha256 check (manifest {rec.sha256[:12]}...); "
                                    f"the file is corrupt: delete it and its manifest entries and re-extract.")
        with self._lock:
            self._verified.add(s)

    def _shard(self, s: int) -> _OpenShard:
        if s in self._open:
            self._open.move_to_end(s)
            return self._open[s]
        rec = self.shards[s]
        path = self.store_dir / rec.file
        if not path.exists() or path.stat().st_size != rec.num_bytes:
            raise CorruptShardError(f"shard {path} is missing or its size differs from the manifest; re-extract it.")
        try:
            shard = _OpenShard(path, self.header)
        except Exception as exc:
            raise CorruptShardError(f"shard {path} cannot be read as safetensors ({exc}).") from exc
        self._open[s] = shard
        while len(self._open) > self._max_open:
            self._open.popitem(last=False)
        return shard

    def __getitem__(self, i: int) -> dict:
        """Return sample ``i``: sample_id, input_ids (int64), loss_mask (bool), aux_hidden, final_hidden.

        With ``dequantize=False`` an int8 store gives aux_hidden / final_hidden as
        Int8Encoded, for the trainer to move to the GPU and dequantize there.
        """
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample index {i} out of range for a store of {n} samples.")
        s = bisect.bisect_right(self._starts, i) - 1
        j = i - self._starts[s]
        h = self.header
        self._verify(s)
        with self._lock:
            shard = self._shard(s)
            a, b = shard.token_offsets[j], shard.token_offsets[j + 1]
            f = shard.handle
            out = {
                "sample_id": shard.sample_ids[j],
                "input_ids": f.get_slice("input_ids")[a:b].to(torch.int64),
                "loss_mask": f.get_slice("loss_mask")[a:b].clone(),
            }
            raw = {}
            for name in _HIDDEN_NAMES:
                if h.encoding == "bf16":
                    out[name] = f.get_slice(name)[a:b]
                else:
                    fa, fb = shard.frame_offsets[name][j], shard.frame_offsets[name][j + 1]
                    raw[name] = (f.get_slice(f"{name}.zstd")[fa:fb], f.get_slice(f"{name}.scale")[a:b],
                                 f.get_slice(f"{name}.outlier_index")[a:b], f.get_slice(f"{name}.outlier_value")[a:b])
        # Decoding happens outside the lock so a prefetch thread and the caller overlap.
        for name in _HIDDEN_NAMES:
            if h.encoding == "bf16":
                # Slices are views of the shard's mmap; copying here makes the
                # prefetch thread, not the training step, pay for the disk read.
                out[name] = out[name].to(self.dtype, copy=True)
                continue
            frame, scale, index, value = raw[name]
            groups = scale.shape[1]
            q = decompress_int8(frame.numpy(), (b - a, groups * h.hidden_size))
            enc = Int8Encoded(q, scale, index, value)
            out[name] = dequantize_int8(enc, self.dtype) if self.dequantize else enc
        return out

    def __iter__(self) -> Iterator[dict]:
        return self.iter_samples()

    def iter_samples(self, indices: Iterable[int] | None = None, prefetch: int = 4,
                     workers: int = 1) -> Iterator[dict]:
        """Yield samples in ``indices`` order, read ahead by ``workers`` background threads, at most ``prefetch`` ahead."""
        if prefetch < 1 or workers < 1:
            raise ValueError(f"prefetch and workers must be >= 1, got {prefetch} and {workers}.")
        pending = iter(list(range(len(self))) if indices is None else list(indices))
        with ThreadPoolExecutor(workers, thread_name_prefix="hidden-state-prefetch") as pool:
            window = deque(pool.submit(self.__getitem__, i) for i in islice(pending, prefetch))
            try:
                while window:
                    ready = window.popleft()
                    for i in islice(pending, 1):
                        window.append(pool.submit(self.__getitem__, i))
                    yield ready.result()  # a reader error surfaces here, in order
            finally:
                # An abandoned iterator must not leave reads running behind it.
                for future in window:
                    future.cancel()


def sample_order(num_samples: int, *, dp_rank: int = 0, dp_size: int = 1, seed: int = 0, epoch: int = 0,
                 shuffle: bool = True) -> list[int]:
    """Deterministic per-epoch permutation of sample indices, strided over data-parallel ranks (drops the ragged tail)."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}.")
    if shuffle:
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(num_samples, generator=g).tolist()
    else:
        order = list(range(num_samples))
    usable = num_samples - num_samples % dp_size
    return order[dp_rank:usable:dp_size]


def open_writer(config: HiddenStateStoreConfig, *, target_id: str, config_hash: str, aux_layer_ids: Sequence[int],
                hidden_size: int, rank: int = 0, world_size: int = 1, tag: str | None = None) -> HiddenStateWriter:
    """Build a HiddenStateWriter from a config plus the target's identity and this writer's rank."""
    if not config.store_dir:
        raise ValueError("hidden-state store_dir is empty; set it to the directory to extract into.")
    return HiddenStateWriter(
        config.store_dir, target_id=target_id, config_hash=config_hash, aux_layer_ids=aux_layer_ids,
        hidden_size=hidden_size, encoding=config.encoding, samples_per_shard=config.samples_per_shard,
        rank=rank, world_size=world_size, tag=tag, outliers_per_token=config.outliers_per_token,
        zstd_level=config.zstd_level, threads=config.writer_threads,
    )


def open_store(config: HiddenStateStoreConfig, *, target_id: str | None = None, config_hash: str | None = None,
               aux_layer_ids: Sequence[int] | None = None, hidden_size: int | None = None,
               dtype: torch.dtype = torch.bfloat16, dequantize: bool = True) -> HiddenStateStore:
    """Open a finalized store from a config, checking it was extracted for the expected target."""
    if not config.store_dir:
        raise ValueError("hidden-state store_dir is empty; set it to a finalized store directory.")
    return HiddenStateStore(config.store_dir, target_id=target_id, config_hash=config_hash,
                            aux_layer_ids=aux_layer_ids, hidden_size=hidden_size,
                            verify_sha256=config.verify_sha256, dtype=dtype, dequantize=dequantize)
