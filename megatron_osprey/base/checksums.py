"""Content checksums of files."""

from __future__ import annotations

import hashlib
import os


def file_sha256(path: str | os.PathLike, chunk_size: int = 16 << 20) -> str:
    """The hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()
