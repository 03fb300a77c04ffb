"""Content checksums of files, and a directory's record of them (a checkpoint's checksums.json)."""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megatron_osprey.base.atomic_io import write_text_atomic


def file_sha256(path: str | os.PathLike, chunk_size: int = 16 << 20) -> str:
    """The hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


CHECKSUMS_FILE = "checksums.json"


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != CHECKSUMS_FILE)


def write_checksums(directory: str | os.PathLike) -> Path:
    """Record every file's size and sha256 in DIRECTORY/checksums.json (hashed in parallel: hashlib frees the GIL)."""
    directory = Path(directory)
    files = _files(directory)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(file_sha256, files))
    record = {
        p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "sha256": d} for p, d in zip(files, digests)
    }
    path = directory / CHECKSUMS_FILE
    write_text_atomic(path, json.dumps({"files": record}, indent=1, sort_keys=True) + "\n")
    return path


def verify_checksums(directory: str | os.PathLike, skip_hint: str) -> bool:
    """Refuse a directory whose files differ from its checksums.json, naming the first; False when it has none.

    `skip_hint` is how the user accepts the files unchecked (a flag), said in the refusal.
    """
    directory = Path(directory)
    record_path = directory / CHECKSUMS_FILE
    if not record_path.is_file():
        return False
    try:
        recorded = json.loads(record_path.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{record_path} is not a valid checksum record; {skip_hint} to load unchecked.") from None
    present = {p.relative_to(directory).as_posix() for p in _files(directory)}
    # A file added later is harmless: only what .metadata (itself recorded) names is ever read.
    missing = sorted(set(recorded) - present)
    if missing:
        raise ValueError(f"{directory / missing[0]} is missing (recorded in {record_path}); the copy is incomplete.")
    names = sorted(recorded)
    sizes = [(directory / n).stat().st_size for n in names]
    for name, size in zip(names, sizes):
        if size != recorded[name]["bytes"]:
            raise ValueError(
                _mismatch(directory / name, f"{size} bytes", f"{recorded[name]['bytes']} bytes", skip_hint)
            )
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(file_sha256, [directory / n for n in names]))
    for name, digest in zip(names, digests):
        if digest != recorded[name]["sha256"]:
            raise ValueError(
                _mismatch(
                    directory / name, f"sha256 {digest[:12]}...", recorded[name]["sha256"][:12] + "...", skip_hint
                )
            )
    return True


def skipped_checksum_note(path: str | os.PathLike) -> str:
    """The line a stage prints when --skip-checksum let it load PATH's checkpoint files unverified."""
    return f"--skip-checksum: the files of {path} were loaded without verification"


def _mismatch(path: Path, found: str, recorded: str, skip_hint: str) -> str:
    return (
        f"{path} is corrupt: it has {found} but the save recorded {recorded}; load another iteration "
        f"(--ckpt-step) or a fresh copy ({skip_hint} to load it anyway)."
    )
