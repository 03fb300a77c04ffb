"""The reader: random access to a finalized store, and prefetching iteration in any sample order."""

from __future__ import annotations

import bisect
import json
import os
import threading
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch
from safetensors import safe_open

from megatron_osprey.base.checksums import file_sha256
from megatron_osprey.data.hidden_state_quant import Int8Encoded, decompress_int8, dequantize_int8
from megatron_osprey.data.hidden_state_store.format import (
    FORMAT_VERSION,
    HIDDEN_NAMES,
    MANIFEST_NAME,
    PART_PREFIX,
    CorruptShardError,
    HiddenStateStoreConfig,
    ShardRecord,
    StoreHeader,
    StoreMismatchError,
    checked_shard_file,
)
from megatron_osprey.data.hidden_state_store.manifest import read_json
from megatron_osprey.data.hidden_state_store.rollout import read_rounds


class _OpenShard:
    def __init__(self, path: Path, header: StoreHeader) -> None:
        self.handle = safe_open(str(path), framework="pt")
        self.token_offsets = self.handle.get_tensor("token_offsets").tolist()
        self.sample_ids = json.loads(self.handle.metadata()["sample_ids"])
        self.frame_offsets = {}
        if header.encoding == "int8":
            for name in HIDDEN_NAMES:
                self.frame_offsets[name] = self.handle.get_tensor(f"{name}.zstd_offsets").tolist()
        if header.rollout_steps:
            self.round_offsets = self.handle.get_tensor("rollout.round_offsets").tolist()


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
            hint = (
                " It has manifest parts: call finalize_store on it once every writer is done."
                if list(self.store_dir.glob(f"{PART_PREFIX}*.json"))
                else ""
            )
            raise FileNotFoundError(
                f"{path} does not exist, so {self.store_dir} is not a finished hidden-state store.{hint}"
            )
        self.manifest = read_json(path)
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise StoreMismatchError(
                f"{path} has format version {self.manifest.get('format_version')}; "
                f"this code reads version {FORMAT_VERSION}."
            )
        self.header = StoreHeader.from_json(self.manifest["store"])
        expected = {
            "target_id": target_id,
            "config_hash": config_hash,
            "aux_layer_ids": None if aux_layer_ids is None else tuple(aux_layer_ids),
            "hidden_size": hidden_size,
        }
        wrong = [
            f"{k} is {getattr(self.header, k)!r}, expected {v!r}"
            for k, v in expected.items()
            if v is not None and getattr(self.header, k) != v
        ]
        if wrong:
            raise StoreMismatchError(
                f"hidden-state store {self.store_dir} does not match this run: {'; '.join(wrong)}. "
                f"Re-extract hidden states for this target or point to the right store."
            )
        self.shards = [ShardRecord(**s) for s in self.manifest["shards"]]
        for rec in self.shards:
            checked_shard_file(self.store_dir, rec.file, path)
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
            raise CorruptShardError(
                f"shard {path} fails its sha256 check (manifest {rec.sha256[:12]}...); "
                f"the file is corrupt: delete it and its manifest entries and re-extract."
            )
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
        """Return sample ``i``: sample_id, input_ids (int64), loss_mask (bool), aux_hidden, final_hidden, and in a
        rollout store its verify rounds under "rollout" (a RolloutRounds).

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
            if h.rollout_steps:
                out["rollout"] = read_rounds(f, shard.round_offsets, j)
            raw = {}
            for name in HIDDEN_NAMES:
                if h.encoding == "bf16":
                    out[name] = f.get_slice(name)[a:b]
                else:
                    fa, fb = shard.frame_offsets[name][j], shard.frame_offsets[name][j + 1]
                    raw[name] = (
                        f.get_slice(f"{name}.zstd")[fa:fb],
                        f.get_slice(f"{name}.scale")[a:b],
                        f.get_slice(f"{name}.outlier_index")[a:b],
                        f.get_slice(f"{name}.outlier_value")[a:b],
                    )
        # Decoding happens outside the lock so a prefetch thread and the caller overlap.
        for name in HIDDEN_NAMES:
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

    def iter_tokens(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids int64, loss_mask bool) of every sample in store order; hidden states are not read."""
        for s in range(len(self.shards)):
            self._verify(s)
            with self._lock:
                shard = self._shard(s)
                input_ids = shard.handle.get_tensor("input_ids").to(torch.int64)
                loss_mask = shard.handle.get_tensor("loss_mask")
                offsets = list(shard.token_offsets)
            for a, b in zip(offsets[:-1], offsets[1:]):
                yield input_ids[a:b], loss_mask[a:b]

    def __iter__(self) -> Iterator[dict]:
        return self.iter_samples()

    def iter_samples(self, indices: Iterable[int] | None = None, prefetch: int = 4, workers: int = 1) -> Iterator[dict]:
        """Yield samples in ``indices`` order, read ahead by ``workers`` threads, at most ``prefetch`` ahead."""
        if prefetch < 1 or workers < 1:
            raise ValueError(f"prefetch and workers must be >= 1, got {prefetch} and {workers}.")
        pending = iter(range(len(self)) if indices is None else indices)  # may be endless: read lazily
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


def open_store(
    config: HiddenStateStoreConfig,
    *,
    target_id: str | None = None,
    config_hash: str | None = None,
    aux_layer_ids: Sequence[int] | None = None,
    hidden_size: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    dequantize: bool = True,
) -> HiddenStateStore:
    """Open a finalized store from a config, checking it was extracted for the expected target."""
    if not config.store_dir:
        raise ValueError("hidden-state store_dir is empty; set it to a finalized store directory.")
    return HiddenStateStore(
        config.store_dir,
        target_id=target_id,
        config_hash=config_hash,
        aux_layer_ids=aux_layer_ids,
        hidden_size=hidden_size,
        verify_sha256=config.verify_sha256,
        dtype=dtype,
        dequantize=dequantize,
    )
