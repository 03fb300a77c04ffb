"""Read the key/value metadata of a GGUF file (tensors are not needed for tokenizers)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

_MAGIC = b"GGUF"

# GGUF value type ids -> numpy dtype (little-endian), for scalar and numeric arrays.
_NUMERIC = {
    0: np.dtype("<u1"),
    1: np.dtype("<i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("<u1"),  # bool, one byte
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
_STRING = 8
_ARRAY = 9


def _read_exact(f: BinaryIO, n: int, path: Path) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError(f"GGUF file {path} is truncated.")
    return data


def _read_u32(f: BinaryIO, path: Path) -> int:
    return struct.unpack("<I", _read_exact(f, 4, path))[0]


def _read_u64(f: BinaryIO, path: Path) -> int:
    return struct.unpack("<Q", _read_exact(f, 8, path))[0]


def _read_string(f: BinaryIO, path: Path) -> str:
    return _read_exact(f, _read_u64(f, path), path).decode("utf-8")


def _read_value(f: BinaryIO, vtype: int, path: Path) -> Any:
    if vtype == _STRING:
        return _read_string(f, path)
    if vtype == _ARRAY:
        item_type = _read_u32(f, path)
        count = _read_u64(f, path)
        if item_type in _NUMERIC:
            dtype = _NUMERIC[item_type]
            values = np.frombuffer(_read_exact(f, dtype.itemsize * count, path), dtype=dtype)
            return values.astype(bool).tolist() if item_type == 7 else values.tolist()
        return [_read_value(f, item_type, path) for _ in range(count)]
    if vtype in _NUMERIC:
        dtype = _NUMERIC[vtype]
        value = np.frombuffer(_read_exact(f, dtype.itemsize, path), dtype=dtype)[0].item()
        return bool(value) if vtype == 7 else value
    raise ValueError(f"GGUF file {path} has an unknown metadata value type {vtype}.")


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Return the metadata key/value pairs of a GGUF (version 2 or 3) file."""
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(4) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic bytes).")
        version = _read_u32(f, path)
        if version not in (2, 3):
            raise ValueError(f"GGUF file {path} has version {version}; only versions 2 and 3 are supported.")
        _read_u64(f, path)  # tensor count: vocab-only files have none we need
        kv_count = _read_u64(f, path)
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = _read_string(f, path)
            metadata[key] = _read_value(f, _read_u32(f, path), path)
    return metadata
