"""Write a Megatron indexed dataset (PREFIX.bin/.idx) under temporary names, then move it into place.

The .idx layout is megatron.core's (datasets/indexed_dataset.py, _IndexWriter): header, version, dtype code,
sequence and document counts, int32 sequence lengths, int64 byte pointers, int64 document indices. It is
written here with numpy alone, so preprocessing never imports megatron.core (and torch with it: seconds of
start-up per run); a unit test checks the bytes against megatron.core's IndexedDatasetBuilder.
"""

from __future__ import annotations

import os
import shutil
import struct

import numpy as np

from megatron_osprey.base.atomic_io import fsync_dir, fsync_file

_PARTIAL = ".partial"
_INDEX_HEADER = b"MMIDIDX\x00\x00"
_INDEX_VERSION = 1
# megatron.core's DType codes.
_DTYPE_CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}
# Header, version, dtype code, then the sequence and document counts.
_PREAMBLE = len(_INDEX_HEADER) + 8 + 1


def get_bin_path(prefix: str) -> str:
    """PREFIX.bin, as megatron.core names it."""
    return prefix + ".bin"


def get_idx_path(prefix: str) -> str:
    """PREFIX.idx, as megatron.core names it."""
    return prefix + ".idx"


def remove_indexed_dataset(prefix: str) -> None:
    """Delete PREFIX.bin/.idx if present."""
    for path in (get_idx_path(prefix), get_bin_path(prefix)):
        if os.path.exists(path):
            os.remove(path)


def read_index(prefix: str) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """(token dtype, int32 sequence lengths, int64 document indices) of PREFIX.idx."""
    path = get_idx_path(prefix)
    with open(path, "rb") as f:
        head = f.read(_PREAMBLE + 16)
        if head[: len(_INDEX_HEADER)] != _INDEX_HEADER:
            raise ValueError(f"{path} is not a Megatron indexed-dataset index (bad header).")
        code = head[_PREAMBLE - 1]
        names = {v: k for k, v in _DTYPE_CODES.items()}
        if code not in names:
            raise ValueError(f"{path}: unknown token dtype code {code}.")
        n_seq, n_doc = struct.unpack("<QQ", head[_PREAMBLE:])
        lengths = np.fromfile(f, dtype=np.int32, count=n_seq)
        f.seek(8 * n_seq, os.SEEK_CUR)  # the pointers follow from the lengths
        documents = np.fromfile(f, dtype=np.int64, count=n_doc)
    return np.dtype(names[code]), lengths, documents


class AtomicIndexedWriter:
    """An indexed dataset written into PREFIX.{bin,idx}.partial; `commit` renames both into place."""

    def __init__(self, prefix: str, dtype: np.dtype) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype.name not in _DTYPE_CODES:
            raise TypeError(f"an indexed dataset cannot store {self.dtype} tokens.")
        self._bin_tmp = get_bin_path(prefix) + _PARTIAL
        self._idx_tmp = get_idx_path(prefix) + _PARTIAL
        self._data = open(self._bin_tmp, "wb")
        self._lengths: list[np.ndarray] = []  # int32 per batch: one sequence per document
        self._documents: list[np.ndarray] = [np.zeros(1, np.int64)]  # sequence index ending each document
        self._sequences = 0
        self._open = True

    def _append_index(self, lengths: np.ndarray, documents: np.ndarray) -> None:
        self._lengths.append(np.asarray(lengths, dtype=np.int32))
        self._documents.append(self._sequences + np.asarray(documents, dtype=np.int64))
        self._sequences += len(lengths)

    def add_documents(self, tokens: np.ndarray, doc_lengths: np.ndarray) -> None:
        """Append many one-sequence documents whose tokens are concatenated in `tokens`."""
        if tokens.dtype != self.dtype:
            raise TypeError(f"tokens are {tokens.dtype}, the dataset stores {self.dtype}.")
        if len(doc_lengths) == 0:
            return
        # Equivalent to IndexedDatasetBuilder.add_document() per document (a unit test checks the bytes).
        self._data.write(memoryview(np.ascontiguousarray(tokens)).cast("B"))
        self._append_index(doc_lengths, np.arange(1, len(doc_lengths) + 1))

    def add_index(self, prefix: str) -> None:
        """Append a whole finished indexed dataset (used to merge partitions), as IndexedDatasetBuilder.add_index."""
        dtype, lengths, documents = read_index(prefix)
        if dtype != self.dtype:
            raise TypeError(f"{get_idx_path(prefix)} stores {dtype} tokens, this dataset {self.dtype}.")
        self._append_index(lengths, documents[1:])
        with open(get_bin_path(prefix), "rb") as f:
            shutil.copyfileobj(f, self._data)

    def _write_index(self, path: str) -> None:
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        documents = np.concatenate(self._documents)
        pointers = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        with open(path, "wb") as f:
            f.write(_INDEX_HEADER)
            f.write(struct.pack("<QB", _INDEX_VERSION, _DTYPE_CODES[self.dtype.name]))
            f.write(struct.pack("<QQ", len(lengths), len(documents)))
            for array in (lengths, pointers, documents):
                f.write(array.tobytes())

    def commit(self) -> None:
        """Write the index and move .bin then .idx to their final names."""
        self._data.close()
        self._open = False
        self._write_index(self._idx_tmp)
        fsync_file(self._bin_tmp)
        fsync_file(self._idx_tmp)
        final_bin, final_idx = get_bin_path(self.prefix), get_idx_path(self.prefix)
        # Drop an old index first so no reader ever pairs it with the new .bin.
        if os.path.exists(final_idx):
            os.remove(final_idx)
        os.replace(self._bin_tmp, final_bin)
        os.replace(self._idx_tmp, final_idx)
        fsync_dir(os.path.dirname(os.path.abspath(final_bin)))

    def abort(self) -> None:
        """Close and delete the temporary files; the final names are untouched."""
        if self._open:
            self._data.close()
            self._open = False
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)
