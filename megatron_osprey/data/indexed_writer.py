"""Write a Megatron indexed dataset (PREFIX.bin/.idx) under temporary names, then move it into place."""

from __future__ import annotations

import os

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

from megatron_osprey.base.atomic_io import fsync_dir, fsync_file

_PARTIAL = ".partial"


def remove_indexed_dataset(prefix: str) -> None:
    """Delete PREFIX.bin/.idx if present."""
    for path in (get_idx_path(prefix), get_bin_path(prefix)):
        if os.path.exists(path):
            os.remove(path)


class AtomicIndexedWriter:
    """IndexedDatasetBuilder into PREFIX.{bin,idx}.partial; `commit` renames both into place."""

    def __init__(self, prefix: str, dtype: np.dtype) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        self._bin_tmp = get_bin_path(prefix) + _PARTIAL
        self._idx_tmp = get_idx_path(prefix) + _PARTIAL
        self._builder = IndexedDatasetBuilder(self._bin_tmp, dtype=self.dtype.type)
        self._open = True

    def add_documents(self, tokens: np.ndarray, doc_lengths: np.ndarray) -> None:
        """Append many one-sequence documents whose tokens are concatenated in `tokens`."""
        if tokens.dtype != self.dtype:
            raise TypeError(f"tokens are {tokens.dtype}, the dataset stores {self.dtype}.")
        if len(doc_lengths) == 0:
            return
        # Equivalent to add_document() per document (a unit test checks the bytes),
        # but one large write and two list extends per batch instead of per-doc calls.
        b = self._builder
        b.data_file.write(memoryview(np.ascontiguousarray(tokens)).cast("B"))
        start = len(b.sequence_lengths)
        b.sequence_lengths.extend(doc_lengths.tolist())
        b.document_indices.extend(range(start + 1, start + len(doc_lengths) + 1))

    def add_index(self, prefix: str) -> None:
        """Append a whole finished indexed dataset (used to merge partitions)."""
        self._builder.add_index(prefix)

    def commit(self) -> None:
        """Finalize the index and move .bin then .idx to their final names."""
        self._builder.finalize(self._idx_tmp)
        self._open = False
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
            self._builder.data_file.close()
            self._open = False
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)
