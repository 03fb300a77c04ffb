"""Readers that stream text records in order from JSONL (plain, gzip, zstd), Parquet or `datasets`.

A source yields `RecordBatch`es: consecutive records with the index of the
first one, so malformed records can be reported by line (JSONL) or row
(tables). Parsing and validation happen in the encoding workers, not here,
so the reading process stays cheap.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import zlib
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional

JSONL = "jsonl"  # payload: list of raw lines (bytes), parsed by the worker
VALUES = "values"  # payload: list of column values (str, None or anything else)

_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_PARQUET_MAGIC = b"PAR1"
_READ_BLOCK = 8 << 20
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_FILE_SUFFIXES = (".json", ".jsonl", ".gz", ".zst", ".zstd", ".parquet", ".txt", ".arrow")


@dataclass(frozen=True)
class RecordBatch:
    """Consecutive input records; `first_record` is the 0-based index of the first one."""

    first_record: int
    kind: str
    payload: List[Any]

    def __len__(self) -> int:
        return len(self.payload)

    def slice(self, start: int, stop: int) -> "RecordBatch":
        """Records [start, stop) of this batch, relative to its first record."""
        return RecordBatch(self.first_record + start, self.kind, self.payload[start:stop])


class TextSource:
    """An input that can be counted and streamed as record batches, in a stable order."""

    unit = "record"

    def __init__(self, name: str, json_key: str) -> None:
        self.name = name
        self.json_key = json_key

    def count_records(self) -> int:
        """Number of records (lines or rows) in the input."""
        raise NotImplementedError

    def batches(self, batch_bytes: int) -> Iterator[RecordBatch]:
        """Stream all records in order, about `batch_bytes` of input per batch."""
        raise NotImplementedError

    def describe(self, record: int) -> str:
        """Where a record is: 'data.jsonl line 12' (1-based) or 'data.parquet row 11' (0-based)."""
        return f"{self.name} {self.unit} {record + (1 if self.unit == 'line' else 0)}"

    def fingerprint(self) -> dict:
        """Identity of the input, stored in partition markers to detect a changed input."""
        return {"name": self.name, "json_key": self.json_key, **_stat_fingerprint(self.name)}


def _stat_fingerprint(path: str) -> dict:
    if os.path.isfile(path):
        st = os.stat(path)
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if os.path.isdir(path):
        files = []
        for root, _, names in os.walk(path):
            for n in sorted(names):
                st = os.stat(os.path.join(root, n))
                files.append([os.path.relpath(os.path.join(root, n), path), st.st_size, st.st_mtime_ns])
        return {"files": sorted(files)}
    return {}


# What a truncated or damaged gzip stream raises while it is read (EOFError and zlib.error are not OSErrors).
_DAMAGED_STREAM = (EOFError, zlib.error, gzip.BadGzipFile)


class JsonlSource(TextSource):
    """JSON Lines, optionally gzip or zstd compressed (detected from the file's magic bytes)."""

    unit = "line"

    def __init__(self, path: str, json_key: str, compression: Optional[str]) -> None:
        super().__init__(path, json_key)
        self.compression = compression

    def _open(self) -> io.BufferedIOBase:
        if self.compression is None:
            return open(self.name, "rb", buffering=_READ_BLOCK)
        if self.compression == "gzip":
            return gzip.open(self.name, "rb")
        try:
            import zstandard
        except ImportError as err:
            raise ImportError(f"--input {self.name} is zstd-compressed; install zstandard==0.25.0 to read it.") from err
        raw = open(self.name, "rb", buffering=_READ_BLOCK)
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=True)
        return io.BufferedReader(reader, buffer_size=_READ_BLOCK)

    def count_records(self) -> int:
        """Lines in the (decompressed) file; a last line without newline counts too."""
        count, last = 0, b"\n"
        try:
            with self._open() as f:
                for block in iter(lambda: f.read(_READ_BLOCK), b""):
                    count += block.count(b"\n")
                    last = block[-1:]
        except _DAMAGED_STREAM as err:
            raise self._damaged(err, count) from None
        return count + (0 if last == b"\n" else 1)

    def batches(self, batch_bytes: int) -> Iterator[RecordBatch]:
        record = 0
        try:
            with self._open() as f:
                while True:
                    # readlines(hint) stops at the first line boundary past `hint` bytes, in C.
                    lines = f.readlines(batch_bytes)
                    if not lines:
                        return
                    yield RecordBatch(record, JSONL, lines)
                    record += len(lines)
        except _DAMAGED_STREAM as err:
            raise self._damaged(err, record) from None

    def _damaged(self, err: BaseException, lines: int) -> ValueError:
        return ValueError(
            f"--input {self.name}: the {self.compression} stream is truncated or damaged after line {lines} ({err}); "
            f"compress it again."
        )


class ParquetSource(TextSource):
    """One column of a Parquet file."""

    unit = "row"

    def __init__(self, path: str, json_key: str) -> None:
        super().__init__(path, json_key)
        import pyarrow.parquet as pq

        self._file = pq.ParquetFile(path)
        if json_key not in self._file.schema_arrow.names:
            raise KeyError(
                f"--json-key {json_key!r} is not a column of --input {path} "
                f"(columns: {', '.join(self._file.schema_arrow.names)})."
            )

    def count_records(self) -> int:
        return int(self._file.metadata.num_rows)

    def batches(self, batch_bytes: int) -> Iterator[RecordBatch]:
        meta = self._file.metadata
        total = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        rows = max(1, int(batch_bytes * max(meta.num_rows, 1) / max(total, 1)))
        record = 0
        for table in self._file.iter_batches(batch_size=rows, columns=[self.json_key]):
            values = table.column(0).to_pylist()
            yield RecordBatch(record, VALUES, values)
            record += len(values)


class DatasetSource(TextSource):
    """One column of a `datasets` Dataset (saved with save_to_disk, or loaded from a hub)."""

    unit = "row"

    def __init__(self, name: str, json_key: str, dataset: Any) -> None:
        super().__init__(name, json_key)
        if json_key not in dataset.column_names:
            raise KeyError(
                f"--json-key {json_key!r} is not a column of --input {name} "
                f"(columns: {', '.join(dataset.column_names)})."
            )
        self._dataset = dataset.select_columns([json_key])

    def count_records(self) -> int:
        return len(self._dataset)

    def batches(self, batch_bytes: int) -> Iterator[RecordBatch]:
        # Rows per batch from the Arrow size, so batches hold about batch_bytes of text.
        n = max(len(self._dataset), 1)
        nbytes = max(self._dataset.data.nbytes, 1)
        rows = max(1, int(batch_bytes * n / nbytes))
        record = 0
        for table in self._dataset.with_format("arrow").iter(batch_size=rows):
            values = table.column(0).to_pylist()
            yield RecordBatch(record, VALUES, values)
            record += len(values)


def _pick_split(dataset: Any, split: str, name: str) -> Any:
    from datasets import DatasetDict

    if isinstance(dataset, DatasetDict):
        if split not in dataset:
            raise KeyError(f"--split {split!r} is not in --input {name} (splits: {', '.join(dataset)}).")
        return dataset[split]
    return dataset


def _looks_like_hub_name(name: str) -> bool:
    return bool(_HUB_NAME.match(name)) and not name.lower().endswith(_FILE_SUFFIXES)


def open_text_source(input_path: str, json_key: str, split: str = "train") -> TextSource:
    """Open --input as JSONL (.gz/.zst), Parquet, a saved `datasets` directory or a hub dataset name."""
    if os.path.isdir(input_path):
        from datasets import load_from_disk

        try:
            dataset = load_from_disk(input_path)
        except FileNotFoundError as err:
            raise FileNotFoundError(
                f"--input {input_path} is a directory but not a dataset saved with datasets' save_to_disk ({err})."
            ) from err
        return DatasetSource(input_path, json_key, _pick_split(dataset, split, input_path))
    if os.path.isfile(input_path):
        with open(input_path, "rb") as f:
            magic = f.read(4)
        if magic == _PARQUET_MAGIC:
            return ParquetSource(input_path, json_key)
        if magic[:2] == _GZIP_MAGIC:
            return JsonlSource(input_path, json_key, "gzip")
        if magic == _ZSTD_MAGIC:
            return JsonlSource(input_path, json_key, "zstd")
        return JsonlSource(input_path, json_key, None)
    if not _looks_like_hub_name(input_path):
        raise FileNotFoundError(f"--input {input_path} does not exist.")
    from datasets import load_dataset

    try:
        dataset = load_dataset(input_path, split=split)
    except Exception as err:  # datasets raises many types (ConnectionError, hub errors, ...)
        raise ConnectionError(
            f"--input {input_path} is not a local file or directory, and loading it as a "
            f"Hugging Face Hub dataset failed (is the hub reachable from here?): {err}"
        ) from err
    return DatasetSource(input_path, json_key, dataset)
