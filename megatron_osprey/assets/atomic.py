"""Atomic file and directory writes for the tokenizer cache."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable


def fsync_dir(path: Path) -> None:
    """Flush a directory entry so a rename inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write data to path through a temporary file, fsync and os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write obj as indented UTF-8 JSON to path atomically."""
    write_bytes_atomic(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))


def make_staging_dir(parent: Path, name: str) -> Path:
    """Create an empty hidden staging directory beside the final location of name."""
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".staging", dir=parent))


def publish_dir(staging: Path, final: Path, is_valid: Callable[[Path], bool]) -> None:
    """Move a fully written staging directory to final; keep a valid final another process published."""
    for child in staging.iterdir():
        if child.is_file():
            with open(child, "rb") as f:
                os.fsync(f.fileno())
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
