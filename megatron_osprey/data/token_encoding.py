"""Turn a batch of raw records into one flat token array (EOD after each document).

This runs inside the encoding worker processes: it parses and validates the
records, encodes all valid documents with one Rust batch call, and returns
numpy arrays so the writing process does no per-token work.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import numpy as np

from megatron_osprey.data.fast_tokenizer import TokenizerSpec
from megatron_osprey.data.text_sources import JSONL, RecordBatch

INVALID_JSON = "invalid JSON"
NOT_AN_OBJECT = "not a JSON object"
MISSING_KEY = "missing key"
NOT_A_STRING = "value is not a string"
EMPTY_DOCUMENT = "empty document"


@dataclass
class EncodedBatch:
    """Tokens of the valid documents of one RecordBatch, plus what was skipped and why."""

    first_record: int
    records: int
    tokens: np.ndarray
    doc_lengths: np.ndarray
    input_bytes: int
    problem_counts: Dict[str, int] = field(default_factory=dict)
    # (record index, reason) of the first few problems, in input order.
    problems: List[Tuple[int, str]] = field(default_factory=list)


class BatchEncoder:
    """Validates and encodes RecordBatches with one fast tokenizer."""

    def __init__(
        self,
        spec: TokenizerSpec,
        json_key: str,
        add_special_tokens: bool = True,
        max_problems: int = 10,
    ) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(spec.tokenizer_json)
        self._eod = spec.eod_id
        self._dtype = spec.token_dtype
        self._json_key = json_key
        self._add_special_tokens = add_special_tokens
        self._max_problems = max_problems

    def _texts(self, batch: RecordBatch, counts: Dict[str, int], problems: List) -> Tuple[List[str], int]:
        texts: List[str] = []
        nbytes = 0

        def skip(i: int, kind: str, detail: str = "") -> None:
            counts[kind] = counts.get(kind, 0) + 1
            if len(problems) < self._max_problems:
                problems.append((batch.first_record + i, f"{kind}{detail}"))

        for i, raw in enumerate(batch.payload):
            if batch.kind == JSONL:
                nbytes += len(raw)
                try:
                    record = json.loads(raw)
                except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
                    skip(i, INVALID_JSON, f" ({err})")
                    continue
                except RecursionError:
                    skip(i, INVALID_JSON, " (brackets nested too deeply)")
                    continue
                if not isinstance(record, dict):
                    skip(i, NOT_AN_OBJECT)
                    continue
                if self._json_key not in record:
                    skip(i, MISSING_KEY, f" {self._json_key!r}")
                    continue
                text = record[self._json_key]
            else:
                text = raw
                if text is None:
                    skip(i, MISSING_KEY, f" {self._json_key!r}")
                    continue
            if not isinstance(text, str):
                skip(i, NOT_A_STRING, f" ({type(text).__name__})")
                continue
            if batch.kind != JSONL:
                nbytes += len(text.encode("utf-8"))
            elif b"\\u" in raw and not _encodable(text):  # a lone surrogate escape ("\\ud800") is no text
                skip(i, INVALID_JSON, " (a lone surrogate escape)")
                continue
            # Whitespace-only documents would train nothing but an EOD token.
            if not text or text.isspace():
                skip(i, EMPTY_DOCUMENT)
                continue
            texts.append(text)
        return texts, nbytes

    def encode(self, batch: RecordBatch) -> EncodedBatch:
        """Encode one batch; invalid records are counted and skipped, never raised."""
        counts: Dict[str, int] = {}
        problems: List[Tuple[int, str]] = []
        texts, nbytes = self._texts(batch, counts, problems)
        if any(len(t) > LONG_DOCUMENT_CHARS for t in texts):
            ids = [self._encode_long(t) if len(t) > LONG_DOCUMENT_CHARS else self._encode_one(t) for t in texts]
            return self._batch(batch, ids, nbytes, counts, problems)
        encodings = self._tokenizer.encode_batch_fast(texts, add_special_tokens=self._add_special_tokens)
        ids = [e.ids for e in encodings]
        return self._batch(batch, ids, nbytes, counts, problems)

    def _encode_one(self, text: str, add_special_tokens: bool | None = None) -> np.ndarray:
        special = self._add_special_tokens if add_special_tokens is None else add_special_tokens
        return np.asarray(self._tokenizer.encode_batch_fast([text], add_special_tokens=special)[0].ids, self._dtype)

    def _encode_long(self, text: str) -> np.ndarray:
        """A long document in pieces cut at line ends (as Megatron-LM splits documents into sentences): memory
        then grows with the piece, not the document. Special tokens (a BOS) only open the first piece."""
        pieces = split_long_text(text, LONG_DOCUMENT_CHARS)
        return np.concatenate([self._encode_one(p, self._add_special_tokens and i == 0) for i, p in enumerate(pieces)])

    def _batch(self, batch: RecordBatch, ids: list, nbytes: int, counts, problems) -> EncodedBatch:
        lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int32, count=len(ids))
        eod = (self._eod,)
        # One C-level pass from the id lists into the output dtype; EOD interleaved.
        flat = itertools.chain.from_iterable(itertools.chain(x, eod) for x in ids)
        tokens = np.fromiter(flat, dtype=self._dtype, count=int(lengths.sum()))
        return EncodedBatch(batch.first_record, len(batch), tokens, lengths, nbytes, counts, problems)


# A document longer than this is tokenized in pieces. The tokenizer's per-token bookkeeping costs far more
# than the text (one 15 MB line took 3 GB), so this bounds a worker's memory; shorter documents (nearly
# all) are tokenized whole, exactly as before.
LONG_DOCUMENT_CHARS = 1 << 20


def split_long_text(text: str, limit: int) -> List[str]:
    """`text` in consecutive pieces of at most `limit` characters, cut after a newline, else after a space."""
    pieces, start = [], 0
    while len(text) - start > limit:
        end = start + limit
        cut = text.rfind("\n", start, end) + 1 or text.rfind(" ", start, end) + 1
        if cut <= start:
            cut = end  # no line end or space in a whole piece: cut anywhere
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _encodable(text: str) -> bool:
    """Whether text is UTF-8 encodable: JSON decodes a lone surrogate escape, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
