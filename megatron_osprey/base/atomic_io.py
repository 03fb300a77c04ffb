"""Atomic file and directory writes: a reader sees the old file or the whole new one, never a part.

Every write goes to a temporary name in the destination's directory (same filesystem, so
the rename is atomic), is flushed and fsynced, renamed over the final name with
os.replace, and then the directory entry is fsynced so the rename survives a crash.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator


def fsync_file(path: str | os.PathLike) -> None:
    """Flush one already-written file to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory entry so a rename inside it survives a crash."""
    fsync_file(path)


def temp_name_regex(final_name_regex: str) -> str:
    """A regex matching the temporary names atomic_path uses for final names matching final_name_regex."""
    return rf"\.(?:{final_name_regex})\.[A-Za-z0-9_]+\.tmp"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside path; on success fsync it and rename it over path, on error delete it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; outputs are shared like any other file
    try:
        yield Path(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", encoding: str | None = None) -> Iterator[IO]:
    """Open a temporary file beside path for writing; it replaces path only if the block succeeds."""
    with atomic_path(path) as tmp:
        with open(tmp, mode, encoding=encoding) as handle:
            yield handle


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write data to path atomically."""
    with atomic_open(path, "wb") as handle:
        handle.write(data)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write UTF-8 text to path atomically."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_lines_atomic(path: str | os.PathLike, lines: Iterable[str]) -> None:
    """Stream text lines (each with its own newline) to path atomically."""
    with atomic_open(path, "w", encoding="utf-8") as handle:
        for line in lines:
            handle.write(line)


def write_json_atomic(path: str | os.PathLike, obj: Any, *, indent: int = 2, sort_keys: bool = False) -> None:
    """Write obj as UTF-8 JSON with a final newline to path atomically."""
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, ensure_ascii=False) + "\n"
    write_text_atomic(path, text)


def make_staging_dir(parent: Path, name: str) -> Path:
    """Create an empty hidden staging directory beside the final location of name."""
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".staging", dir=parent))


def publish_dir(staging: Path, final: Path, is_valid: Callable[[Path], bool]) -> None:
    """Move a fully written staging directory to final; keep a valid final another process published."""
    for child in staging.iterdir():
        if child.is_file():
            fsync_file(child)
    fsync_dir(staging)
    try:
        os.replace(staging, final)
    except OSError:
        if not final.exists():
            raise
        if is_valid(final):
            # A concurrent writer got there first; readers may already be using its copy.
            shutil.rmtree(staging, ignore_errors=True)
            return
        # A stale copy: os.replace cannot overwrite a non-empty directory, so move it aside first.
        retired = final.with_name(f".{final.name}.{uuid.uuid4().hex}.retired")
        os.replace(final, retired)
        shutil.rmtree(retired, ignore_errors=True)
        os.replace(staging, final)
    fsync_dir(final.parent)
