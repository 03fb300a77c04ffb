"""Stage-2 data preprocessing: text documents -> Megatron indexed dataset (PREFIX_<key>_document.bin/.idx).

One reading process streams record batches to `workers` encoding processes;
results come back in input order and are appended to an indexed dataset in
megatron.core's format under temporary names (data/indexed_writer.py, which
does not import megatron.core). With `partitions > 1` the input is cut into
record ranges, each committed to its own indexed dataset with a completion
marker, so an interrupted run resumes where it stopped; the partitions are
merged with AtomicIndexedWriter.add_index at the end.

`config` is the preprocess stage's PreprocessConfig (stages/preprocess.py).
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from megatron_osprey.base.atomic_io import write_json_atomic
from megatron_osprey.data.encode_pool import EncodePool, EncoderSettings
from megatron_osprey.data.fast_tokenizer import TokenizerSpec, load_tokenizer_spec
from megatron_osprey.data.indexed_writer import (
    AtomicIndexedWriter,
    get_bin_path,
    get_idx_path,
    remove_indexed_dataset,
)
from megatron_osprey.data.text_sources import RecordBatch, TextSource, open_text_source
from megatron_osprey.data.token_encoding import EncodedBatch

logger = logging.getLogger(__name__)

MARKER_SUFFIX = ".done.json"
_MARKER_FORMAT = 1


@dataclass
class PreprocessStats:
    """Counts for a run or one partition; `problems` holds the first few, described."""

    records: int = 0
    documents: int = 0
    tokens: int = 0
    input_bytes: int = 0
    problem_counts: Dict[str, int] = field(default_factory=dict)
    problems: List[str] = field(default_factory=list)

    @property
    def skipped(self) -> int:
        """Records skipped as malformed or empty."""
        return sum(self.problem_counts.values())

    def merge(self, other: "PreprocessStats", max_problems: int) -> None:
        """Add another run's counts; keep the first `max_problems` problem lines."""
        self.records += other.records
        self.documents += other.documents
        self.tokens += other.tokens
        self.input_bytes += other.input_bytes
        for kind, n in other.problem_counts.items():
            self.problem_counts[kind] = self.problem_counts.get(kind, 0) + n
        self.problems.extend(other.problems[: max(0, max_problems - len(self.problems))])


@dataclass
class PreprocessResult:
    """What a run wrote (`stats`, whole output) and what it encoded itself (`encoded`), how fast."""

    dataset_prefix: str
    stats: PreprocessStats
    encoded: PreprocessStats
    seconds: float
    eod_id: int
    eod_token: str
    dtype: str
    partitions_written: int = 0
    partitions_reused: int = 0

    @property
    def tokens_per_second(self) -> float:
        """Tokens this run encoded per second (partitions reused from a previous run excluded)."""
        return self.encoded.tokens / max(self.seconds, 1e-9)


def dataset_prefix(output_prefix: str, json_key: str) -> str:
    """Megatron-LM's naming: PREFIX_<key>_document."""
    return f"{output_prefix}_{json_key}_document"


def partition_prefix(output_prefix: str, json_key: str, index: int) -> str:
    """Prefix of partition `index`: PREFIX_part<index>_<key>_document."""
    return f"{output_prefix}_part{index}_{json_key}_document"


def _exists_any(prefix: str) -> bool:
    return os.path.exists(get_bin_path(prefix)) or os.path.exists(get_idx_path(prefix))


def _validate(config) -> None:
    if config.workers < 1:
        raise ValueError(f"--workers must be at least 1 (got {config.workers}).")
    if config.partitions < 1:
        raise ValueError(f"--partitions must be at least 1 (got {config.partitions}).")
    if not config.json_key:
        raise ValueError("--json-key must not be empty.")
    final = dataset_prefix(config.output_prefix, config.json_key)
    if _exists_any(final) and not config.overwrite:
        raise FileExistsError(
            f"--output-prefix {config.output_prefix}: {final}.bin/.idx already exists; pass --overwrite to replace it."
        )


class _Progress:
    """tqdm bar on stderr counting documents, with tokens/s and MB/s in the postfix."""

    def __init__(self, enabled: bool, total: Optional[int]) -> None:
        from tqdm import tqdm

        self._bar = tqdm(
            total=total,
            unit="doc",
            unit_scale=True,
            file=sys.stderr,
            disable=not enabled,
            mininterval=0.5,
            dynamic_ncols=True,
            desc="preprocess",
        )
        self._start = time.perf_counter()
        self._tokens = 0
        self._bytes = 0

    def update(self, batch: EncodedBatch) -> None:
        self._tokens += len(batch.tokens)
        self._bytes += batch.input_bytes
        dt = max(time.perf_counter() - self._start, 1e-9)
        self._bar.set_postfix_str(f"{self._tokens / dt:,.0f} tok/s, {self._bytes / dt / 1e6:.2f} MB/s", refresh=False)
        self._bar.update(batch.records)

    def close(self) -> None:
        self._bar.close()


def _clip_to_partitions(batches: Iterable[RecordBatch], bounds: List[int]) -> Iterator[Tuple[int, RecordBatch]]:
    """Split batches at partition boundaries; yield (partition index, batch)."""
    for batch in batches:
        start = 0
        while start < len(batch):
            record = batch.first_record + start
            k = bisect.bisect_right(bounds, record) - 1
            stop = min(len(batch), bounds[k + 1] - batch.first_record)
            yield k, batch.slice(start, stop)
            start = stop


def _fingerprint(config, source: TextSource, spec: TokenizerSpec) -> dict:
    return {
        "format": _MARKER_FORMAT,
        "input": source.fingerprint(),
        "tokenizer_sha256": spec.sha256,
        "eod_id": spec.eod_id,
        "dtype": spec.token_dtype.name,
        "add_special_tokens": config.add_special_tokens,
        "partitions": config.partitions,
    }


def _load_done_partition(prefix: str, expected: dict) -> Optional[PreprocessStats]:
    """Stats of a finished partition whose marker matches this run, else None."""
    marker = prefix + MARKER_SUFFIX
    if not all(os.path.isfile(p) for p in (marker, get_bin_path(prefix), get_idx_path(prefix))):
        return None
    try:
        with open(marker, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    if saved.get("fingerprint") != expected:
        logger.info("partition %s was made from different input or settings; redoing it", prefix)
        return None
    stats = PreprocessStats(**saved["stats"])
    # A truncated .bin (e.g. a disk-full copy) must not pass for a finished partition.
    if os.path.getsize(get_bin_path(prefix)) != stats.tokens * np.dtype(expected["dtype"]).itemsize:
        return None
    return stats


class _Run:
    """State of one preprocessing run (writers, stats, strict checks)."""

    def __init__(self, config, source: TextSource, spec: TokenizerSpec) -> None:
        self.config = config
        self.source = source
        self.spec = spec
        self.total = PreprocessStats()  # with partitions: only what this run encodes
        self.partition_stats: Dict[int, PreprocessStats] = {}

    def absorb(self, stats: PreprocessStats, batch: EncodedBatch) -> None:
        """Count one encoded batch into `stats`; in strict mode, fail on its first problem."""
        if self.config.strict and batch.problem_counts:
            record, reason = batch.problems[0] if batch.problems else (batch.first_record, "malformed")
            raise ValueError(
                f"--strict: {self.source.describe(record)}: {reason}; fix it or rerun without "
                "--strict to skip such records."
            )
        stats.records += batch.records
        stats.documents += len(batch.doc_lengths)
        stats.tokens += len(batch.tokens)
        stats.input_bytes += batch.input_bytes
        for kind, n in batch.problem_counts.items():
            stats.problem_counts[kind] = stats.problem_counts.get(kind, 0) + n
        room = self.config.max_reported_problems - len(stats.problems)
        for record, reason in batch.problems[: max(0, room)]:
            stats.problems.append(f"{self.source.describe(record)}: {reason}")


def _refuse_empty(config, stats: PreprocessStats) -> None:
    """A dataset with no document is an error, not a result: training on it cannot start."""
    if stats.documents:
        return
    if not stats.records:
        raise ValueError(f"--input {config.input}: no records found; nothing was written.")
    kinds = ", ".join(f"{k}: {n:,}" for k, n in sorted(stats.problem_counts.items()))
    first = f"; first: {stats.problems[0]}" if stats.problems else ""
    raise ValueError(
        f"--input {config.input}: all {stats.records:,} records were skipped ({kinds}){first}; nothing was "
        f"written. Check --json-key {config.json_key!r} and that the file is UTF-8 text."
    )


def _encode_single(run: _Run, pool: EncodePool, progress: _Progress) -> None:
    prefix = dataset_prefix(run.config.output_prefix, run.config.json_key)
    writer = AtomicIndexedWriter(prefix, run.spec.token_dtype)
    try:
        for batch in pool.imap(run.source.batches(run.config.batch_bytes)):
            run.absorb(run.total, batch)
            writer.add_documents(batch.tokens, batch.doc_lengths)
            progress.update(batch)
        _refuse_empty(run.config, run.total)
        writer.commit()
    except BaseException:
        writer.abort()
        raise


def _encode_partitions(
    run: _Run, pool: EncodePool, progress: _Progress, bounds: List[int], todo: List[int], fingerprint: dict
) -> None:
    cfg = run.config
    todo_set = set(todo)
    pending = list(todo)  # partitions not yet committed, in order
    current: Optional[Tuple[int, AtomicIndexedWriter, PreprocessStats]] = None

    def commit(k: int, writer: AtomicIndexedWriter, stats: PreprocessStats) -> None:
        writer.commit()
        prefix = partition_prefix(cfg.output_prefix, cfg.json_key, k)
        marker = {
            "fingerprint": fingerprint,
            "records": [bounds[k], bounds[k + 1]],
            "stats": asdict(stats),
        }
        write_json_atomic(prefix + MARKER_SUFFIX, marker, indent=1, sort_keys=True)
        run.total.merge(stats, cfg.max_reported_problems)
        run.partition_stats[k] = stats
        pending.remove(k)

    def open_writer(k: int) -> Tuple[int, AtomicIndexedWriter, PreprocessStats]:
        prefix = partition_prefix(cfg.output_prefix, cfg.json_key, k)
        # A stale marker must not vouch for files being rewritten.
        if os.path.exists(prefix + MARKER_SUFFIX):
            os.remove(prefix + MARKER_SUFFIX)
        return k, AtomicIndexedWriter(prefix, run.spec.token_dtype), PreprocessStats()

    def advance_to(k: Optional[int]) -> None:
        # Commit the open partition and any (empty) todo partitions before k.
        nonlocal current
        while pending and (k is None or pending[0] < k):
            if current is None or current[0] != pending[0]:
                current = open_writer(pending[0])
            commit(*current)
            current = None
        if k is not None and (current is None or current[0] != k):
            current = open_writer(k)

    wanted = (b for k, b in _clip_to_partitions(run.source.batches(cfg.batch_bytes), bounds) if k in todo_set)
    try:
        for batch in pool.imap(wanted):
            k = bisect.bisect_right(bounds, batch.first_record) - 1
            advance_to(k)
            run.absorb(current[2], batch)
            current[1].add_documents(batch.tokens, batch.doc_lengths)
            progress.update(batch)
        advance_to(None)
    except BaseException:
        if current is not None:
            current[1].abort()
        raise


def _merge_partitions(config, spec: TokenizerSpec) -> None:
    final = dataset_prefix(config.output_prefix, config.json_key)
    writer = AtomicIndexedWriter(final, spec.token_dtype)
    try:
        for k in range(config.partitions):
            writer.add_index(partition_prefix(config.output_prefix, config.json_key, k))
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    if not config.keep_partitions:
        for k in range(config.partitions):
            prefix = partition_prefix(config.output_prefix, config.json_key, k)
            os.remove(prefix + MARKER_SUFFIX)
            remove_indexed_dataset(prefix)


def preprocess(config) -> PreprocessResult:
    """Tokenize --input into PREFIX_<key>_document.bin/.idx; see the module docstring."""
    _validate(config)
    spec = load_tokenizer_spec(config.tokenizer, config.eod_token)
    logger.info(
        "EOD token %r (id %d) appended to every document; vocabulary %d -> %s tokens",
        spec.eod_token,
        spec.eod_id,
        spec.vocab_size,
        spec.token_dtype.name,
    )
    source = open_text_source(config.input, config.json_key, config.split)
    parent = os.path.dirname(os.path.abspath(config.output_prefix))
    os.makedirs(parent, exist_ok=True)

    run = _Run(config, source, spec)
    start = time.perf_counter()
    written = reused = 0
    if config.partitions == 1:
        total = source.count_records() if source.unit == "row" else None
        progress = _Progress(config.progress, total)
        try:
            with EncodePool(
                EncoderSettings(spec, config.json_key, config.add_special_tokens, config.max_reported_problems),
                config.workers,
            ) as pool:
                _encode_single(run, pool, progress)
        finally:
            progress.close()
    else:
        n = source.count_records()
        bounds = [k * n // config.partitions for k in range(config.partitions + 1)]
        fingerprint = _fingerprint(config, source, spec)
        todo = []
        done_stats: Dict[int, PreprocessStats] = {}
        for k in range(config.partitions):
            stats = _load_done_partition(partition_prefix(config.output_prefix, config.json_key, k), fingerprint)
            if stats is None:
                todo.append(k)
            else:
                done_stats[k] = stats
        reused, written = len(done_stats), len(todo)
        if done_stats:
            logger.info("reusing %d finished partition(s): %s", reused, sorted(done_stats))
        progress = _Progress(config.progress, sum(bounds[k + 1] - bounds[k] for k in todo))
        try:
            if todo:
                with EncodePool(
                    EncoderSettings(spec, config.json_key, config.add_special_tokens, config.max_reported_problems),
                    config.workers,
                ) as pool:
                    _encode_partitions(run, pool, progress, bounds, todo, fingerprint)
        finally:
            progress.close()
        whole = PreprocessStats()
        for k in range(config.partitions):
            whole.merge(done_stats[k] if k in done_stats else run.partition_stats[k], config.max_reported_problems)
        _refuse_empty(config, whole)
        _merge_partitions(config, spec)
    encoded = run.total
    if config.partitions > 1:
        # Output totals in input order, whichever partitions this run redid.
        run.total = PreprocessStats()
        for k in range(config.partitions):
            stats = done_stats[k] if k in done_stats else run.partition_stats[k]
            run.total.merge(stats, config.max_reported_problems)
    result = PreprocessResult(
        dataset_prefix=dataset_prefix(config.output_prefix, config.json_key),
        stats=run.total,
        encoded=encoded,
        seconds=time.perf_counter() - start,
        eod_id=spec.eod_id,
        eod_token=spec.eod_token,
        dtype=spec.token_dtype.name,
        partitions_written=written,
        partitions_reused=reused,
    )
    for line in summary_lines(result):
        logger.info(line)
    return result


def summary_lines(result: PreprocessResult) -> List[str]:
    """Human-readable end-of-run summary (counts, skipped records, first problems, speed)."""
    s, e, dt = result.stats, result.encoded, max(result.seconds, 1e-9)
    lines = [
        f"wrote {result.dataset_prefix}.bin/.idx: {s.documents:,} documents, {s.tokens:,} tokens "
        f"({result.dtype}, EOD id {result.eod_id} {result.eod_token!r} after each document) "
        f"from {s.records:,} records, {s.input_bytes / 1e6:,.1f} MB",
        f"speed: {e.tokens / dt:,.0f} tokens/s, {e.documents / dt:,.0f} docs/s, "
        f"{e.input_bytes / 1e6 / dt:,.2f} MB/s ({e.tokens:,} tokens encoded in {result.seconds:.1f} s)",
    ]
    if result.partitions_reused or result.partitions_written:
        lines.append(
            f"partitions: {result.partitions_written} encoded, {result.partitions_reused} reused from a previous run"
        )
    if s.skipped:
        kinds = ", ".join(f"{k}: {n:,}" for k, n in sorted(s.problem_counts.items()))
        lines.append(f"skipped {s.skipped:,} records ({kinds}); first {len(s.problems)}:")
        lines.extend(f"  {p}" for p in s.problems)
    return lines
