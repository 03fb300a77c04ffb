"""The writer: one writer's shards and manifest part, resumable after a crash or requeue."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch

from megatron_osprey.base.atomic_io import temp_name_regex, write_bytes_atomic
from megatron_osprey.base.locks import LockHeldError, WriterLock, acquire_writer_lock
from megatron_osprey.data.hidden_state_quant import Int8Encoded, check_encoding, compress_int8, quantize_int8
from megatron_osprey.data.hidden_state_store.format import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    PART_PREFIX,
    TAG_RE,
    CorruptShardError,
    HiddenStateStoreConfig,
    ShardRecord,
    StoreHeader,
    StoreMismatchError,
    json_bytes,
    lock_path,
    part_name,
    read_shard_meta,
    shard_name,
    write_safetensors_streamed,
    writer_tag,
)
from megatron_osprey.data.hidden_state_store.manifest import check_header, read_json
from megatron_osprey.data.hidden_state_store.rollout import RolloutRounds, rollout_entries


def _to_cpu(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()


@dataclass
class _EncodedSample:
    sample_id: str
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # bool [T]
    hidden: dict  # name -> bf16 tensor, or name -> (Int8Encoded without q, zstd frame or its Future)
    rollout: RolloutRounds | None = None  # a rollout store's verify rounds (rollout.py)


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
        rollout_steps: int = 0,
        rollout_top_k: int = 0,
    ) -> None:
        check_encoding(encoding)
        if (rollout_steps > 0) != (rollout_top_k > 0) or min(rollout_steps, rollout_top_k) < 0:
            raise ValueError(
                f"rollout_steps and rollout_top_k are both > 0 or both 0, got {rollout_steps}, {rollout_top_k}."
            )
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
            rollout_steps=int(rollout_steps),
            rollout_top_k=int(rollout_top_k),
        )
        if encoding == "int8" and not 0 <= outliers_per_token < hidden_size:
            raise ValueError(f"outliers_per_token must be in [0, hidden_size), got {outliers_per_token}.")
        self.tag = tag if tag is not None else writer_tag(rank, world_size)
        if not TAG_RE.match(self.tag):
            raise ValueError(f"writer tag {self.tag!r} must match {TAG_RE.pattern}.")
        self.store_dir = Path(store_dir)
        self.rank, self.world_size = rank, world_size
        self.samples_per_shard = samples_per_shard
        self.zstd_level = zstd_level
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._lock = self._acquire_lock()
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

    def add(
        self,
        sample_id: str,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        aux_hidden: torch.Tensor,
        final_hidden: torch.Tensor,
        rollout: RolloutRounds | None = None,
    ) -> None:
        """Queue one sample (with its verify rounds in a rollout store); a full shard is written and recorded."""
        if self._closed:
            raise RuntimeError(f"writer {self.tag} is closed.")
        sample_id = str(sample_id)
        if sample_id in self._seen_ids:
            raise ValueError(f"sample id {sample_id!r} was already written by writer {self.tag}.")
        h = self.header
        if (rollout is None) != (h.rollout_steps == 0):
            raise ValueError(
                f"sample {sample_id!r}: a rollout store's samples carry their rounds and no other store's do "
                f"(this store has rollout_steps={h.rollout_steps})."
            )
        encoded = self._encode(sample_id, input_ids, loss_mask, aux_hidden, final_hidden)
        if rollout is not None:
            encoded.rollout = rollout.checked(sample_id, input_ids.shape[0], h.rollout_steps, h.rollout_top_k)
        self._pending.append(encoded)
        self._seen_ids.add(sample_id)
        if len(self._pending) == self.samples_per_shard:
            self._flush(complete=False)

    def add_batch(
        self,
        sample_ids: Sequence[str],
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        aux_hidden: torch.Tensor,
        final_hidden: torch.Tensor,
        lengths: Sequence[int],
    ) -> None:
        """Add the rows of a right-padded batch ([B, S, ...]), row b cut to its first lengths[b] tokens."""
        if not len(sample_ids) == len(lengths) == input_ids.shape[0]:
            raise ValueError(
                f"add_batch got {len(sample_ids)} sample ids, {len(lengths)} lengths and "
                f"{input_ids.shape[0]} rows; they must match."
            )
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

    def _acquire_lock(self) -> WriterLock:
        try:
            return acquire_writer_lock(lock_path(self.store_dir, self.tag), f"{self.store_dir} as writer {self.tag!r}")
        except LockHeldError as exc:
            raise RuntimeError(
                f"another process is writing: {exc} Give each rank or array task its own rank/tag."
            ) from None

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
        self._lock.release()

    def _part_path(self) -> Path:
        return self.store_dir / part_name(self.tag)

    def _load_part(self) -> list[ShardRecord]:
        path = self._part_path()
        if not path.exists():
            return []
        part = read_json(path)
        if part.get("format_version") != FORMAT_VERSION:
            raise StoreMismatchError(
                f"{path} has format version {part.get('format_version')}, expected {FORMAT_VERSION}."
            )
        check_header(StoreHeader.from_json(part["store"]), self.header, path)
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
        others = [p for p in self.store_dir.glob(f"{PART_PREFIX}*.json") if p != self._part_path()]
        merged = self.store_dir / MANIFEST_NAME
        for p in others + ([merged] if merged.exists() else []):
            check_header(StoreHeader.from_json(read_json(p)["store"]), self.header, p)

    def _remove_strays(self) -> None:
        # Unlisted shards of this tag are partial by definition; temp files are leftovers of a kill.
        # Exact patterns, not globs: tag "a" must never match tag "a-b"'s files.
        listed = {s.file for s in self._shards}
        tag = re.escape(self.tag)
        shard_re = re.compile(rf"shard-{tag}-\d{{6}}\.safetensors")
        tmp_re = re.compile(temp_name_regex(rf"shard-{tag}-\d{{6}}\.safetensors|{re.escape(part_name(self.tag))}"))
        for p in self.store_dir.iterdir():
            if (shard_re.fullmatch(p.name) and p.name not in listed) or tmp_re.fullmatch(p.name):
                p.unlink()

    def _load_completed_ids(self) -> set[str]:
        ids: set[str] = set()
        for s in self._shards:
            ids.update(json.loads(read_shard_meta(self.store_dir / s.file)["sample_ids"]))
        return ids

    def _encode(self, sample_id, input_ids, loss_mask, aux_hidden, final_hidden) -> _EncodedSample:
        h = self.header
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(
                f"sample {sample_id!r}: input_ids must be a non-empty 1-D tensor, got {tuple(input_ids.shape)}."
            )
        t = input_ids.shape[0]
        expect = {
            "loss_mask": (t,),
            "aux_hidden": (t, h.num_aux_layers * h.hidden_size),
            "final_hidden": (t, h.hidden_size),
        }
        for name, tensor in (("loss_mask", loss_mask), ("aux_hidden", aux_hidden), ("final_hidden", final_hidden)):
            if tuple(tensor.shape) != expect[name]:
                raise ValueError(
                    f"sample {sample_id!r}: {name} has shape {tuple(tensor.shape)}, expected {expect[name]}."
                )
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
            frame = (
                self._pool.submit(compress_int8, q, self.zstd_level)
                if self._pool is not None
                else compress_int8(q, self.zstd_level)
            )
            meta = Int8Encoded(
                q=torch.empty(0, dtype=torch.int8),
                scale=_to_cpu(enc.scale, torch.float32),
                outlier_index=_to_cpu(enc.outlier_index, torch.int16),
                outlier_value=_to_cpu(enc.outlier_value, torch.bfloat16),
            )
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
        if h.rollout_steps:
            entries += rollout_entries([s.rollout for s in samples], h.rollout_steps, h.rollout_top_k)
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
        sha, size = write_safetensors_streamed(self.store_dir / name, self._shard_tensors(samples), metadata)
        self._shards.append(
            ShardRecord(
                file=name,
                writer=self.tag,
                index=index,
                num_samples=len(samples),
                num_tokens=sum(s.input_ids.shape[0] for s in samples),
                num_bytes=size,
                sha256=sha,
            )
        )
        # The part is rewritten after the shard is durable: a crash in between
        # leaves an unlisted (hence partial) shard that the next run rewrites.
        self._write_part(complete=complete)
        self._done_ids.update(s.sample_id for s in samples)

    def _write_part(self, complete: bool) -> None:
        part = {
            "format_version": FORMAT_VERSION,
            "store": self.header.to_json(),
            "writer": {
                "tag": self.tag,
                "rank": self.rank,
                "world_size": self.world_size,
                "samples_per_shard": self.samples_per_shard,
            },
            "complete": complete,
            "shards": [asdict(s) for s in self._shards],
        }
        write_bytes_atomic(self._part_path(), json_bytes(part))


def open_writer(
    config: HiddenStateStoreConfig,
    *,
    target_id: str,
    config_hash: str,
    aux_layer_ids: Sequence[int],
    hidden_size: int,
    rank: int = 0,
    world_size: int = 1,
    tag: str | None = None,
) -> HiddenStateWriter:
    """Build a HiddenStateWriter from a config plus the target's identity and this writer's rank."""
    if not config.store_dir:
        raise ValueError("hidden-state store_dir is empty; set it to the directory to extract into.")
    return HiddenStateWriter(
        config.store_dir,
        target_id=target_id,
        config_hash=config_hash,
        aux_layer_ids=aux_layer_ids,
        hidden_size=hidden_size,
        encoding=config.encoding,
        samples_per_shard=config.samples_per_shard,
        rank=rank,
        world_size=world_size,
        tag=tag,
        outliers_per_token=config.outliers_per_token,
        zstd_level=config.zstd_level,
        threads=config.writer_threads,
    )
