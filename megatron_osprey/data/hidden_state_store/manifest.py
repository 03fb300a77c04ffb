"""Manifests: each writer's part, and manifest.json merged from them once every writer is done."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from megatron_osprey.base.atomic_io import write_bytes_atomic
from megatron_osprey.data.hidden_state_store.format import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    PART_PREFIX,
    CorruptShardError,
    ShardRecord,
    StoreHeader,
    StoreMismatchError,
    checked_shard_file,
    json_bytes,
    read_shard_meta,
)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path} is not valid JSON ({exc}); it was not written by this store's writers, "
            f"which write manifests atomically."
        ) from exc


def check_header(found: StoreHeader, expected: StoreHeader, where: Path) -> None:
    if found != expected:
        diffs = [
            f"{k}: {getattr(found, k)!r} != {getattr(expected, k)!r}"
            for k in expected.__dataclass_fields__
            if getattr(found, k) != getattr(expected, k)
        ]
        raise StoreMismatchError(
            f"{where} was written with a different store header ({'; '.join(diffs)}); "
            f"use a new store directory or the original settings."
        )


def finalize_store(store_dir: str | os.PathLike, *, require_complete: bool = True) -> Path:
    """Merge every writer's manifest part into manifest.json (run once all writers are done)."""
    store_dir = Path(store_dir)
    parts = sorted(store_dir.glob(f"{PART_PREFIX}*.json"))
    if not parts:
        raise FileNotFoundError(f"no {PART_PREFIX}*.json in {store_dir}; run the extraction before finalizing.")
    loaded = [(p, read_json(p)) for p in parts]
    header = StoreHeader.from_json(loaded[0][1]["store"])
    world_sizes = set()
    ranks = set()
    for p, part in loaded:
        if part.get("format_version") != FORMAT_VERSION:
            raise StoreMismatchError(f"{p} has format version {part.get('format_version')}, expected {FORMAT_VERSION}.")
        check_header(StoreHeader.from_json(part["store"]), header, p)
        if require_complete and not part["complete"]:
            raise RuntimeError(
                f"{p} is not complete: writer {part['writer']['tag']!r} has not finished; "
                f"rerun it (it resumes) before finalizing."
            )
        world_sizes.add(part["writer"]["world_size"])
        ranks.add(part["writer"]["rank"])
    if require_complete:
        if len(world_sizes) != 1:
            raise StoreMismatchError(f"manifest parts in {store_dir} disagree on world_size: {sorted(world_sizes)}.")
        missing = sorted(set(range(world_sizes.pop())) - ranks)
        if missing:
            raise RuntimeError(
                f"{store_dir} has no manifest part from ranks {missing}; run those writers before finalizing."
            )
    shards: list[ShardRecord] = []
    seen_ids: dict[str, str] = {}
    for p, part in sorted(loaded, key=lambda item: (item[1]["writer"]["rank"], item[1]["writer"]["tag"])):
        for s in (ShardRecord(**s) for s in part["shards"]):
            f = store_dir / checked_shard_file(store_dir, s.file, p)
            if not f.exists() or f.stat().st_size != s.num_bytes:
                raise CorruptShardError(f"{f} (listed in {p.name}) is missing or has the wrong size.")
            for sid in json.loads(read_shard_meta(f)["sample_ids"]):
                if sid in seen_ids:
                    raise StoreMismatchError(
                        f"sample id {sid!r} is in both {seen_ids[sid]} and {s.file}; "
                        f"writers must extract disjoint samples."
                    )
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
    write_bytes_atomic(path, json_bytes(manifest))
    return path
