"""Token sequences an n-gram drafter is counted from: text JSONL, or conversations JSONL as the target writes them.

A conversations file contributes each conversation rendered through the target's chat template; the tokens
to predict are the assistant tokens (the chat template's loss mask), while their contexts may reach back into
the prompt and the assistant header, as they do when the target generates. A text file contributes each
row's text, every token a target.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_osprey.data.chat_template import ChatTemplateConfig, ChatTokenizer
from megatron_osprey.data.conversations import load_json, read_conversations

from .ngram import NgramCounter, NgramDrafter

CORPUS_KINDS = ("auto", "text", "conversations")
# Texts tokenized per call of the fast tokenizer's batch API.
_TEXT_BATCH = 512


@dataclass(frozen=True)
class CorpusOptions:
    """How to read the corpora."""

    kind: str = "auto"  # "auto": conversations when the first row has a "conversations" list, else text
    json_key: str = "text"
    enable_thinking: bool | None = None
    limit: int | None = None  # rows per file


def vocab_sha256(tokenizer) -> str:
    """A tokenizer's identity for an n-gram table: the sha256 of its token -> id map (special tokens included)."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode("utf-8")).hexdigest()


def corpus_kind(path: Path, options: CorpusOptions) -> str:
    """'text' or 'conversations' for `path` (its first non-blank row decides under kind 'auto')."""
    if options.kind not in CORPUS_KINDS:
        raise ValueError(f"--corpus-kind must be one of {CORPUS_KINDS}, got {options.kind!r}.")
    if not path.is_file():
        raise FileNotFoundError(f"--input {path}: no such file.")
    if options.kind != "auto":
        return options.kind
    with path.open("rb") as handle:
        for raw in handle:
            if raw.strip():
                try:
                    row = json.loads(raw)
                except (ValueError, RecursionError):
                    raise ValueError(f"--input {path}: its first row is not JSON; a JSONL file is expected.") from None
                if isinstance(row, dict) and isinstance(row.get("conversations"), list):
                    return "conversations"
                if isinstance(row, dict) and isinstance(row.get(options.json_key), str):
                    return "text"
                raise ValueError(
                    f"--input {path}: its first row has neither a 'conversations' list nor a string "
                    f"{options.json_key!r} (--json-key)."
                )
    raise ValueError(f"--input {path} is empty.")


def _text_rows(path: Path, options: CorpusOptions) -> Iterator[str]:
    with path.open("rb") as handle:
        count = 0
        for lineno, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            if options.limit is not None and count >= options.limit:
                return
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"--input {path}:{lineno} is not UTF-8 text ({error.reason}).") from None
            row = load_json(line, f"--input {path}:{lineno}")
            text = row.get(options.json_key) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"--input {path}:{lineno} has no string {options.json_key!r} (--json-key).")
            count += 1
            yield text


def text_sequences(path: Path, tokenizer, options: CorpusOptions) -> Iterator[np.ndarray]:
    """Token ids of each row's text (no special tokens: the target writes text, not BOS)."""
    batch: list[str] = []
    for text in _text_rows(path, options):
        batch.append(text)
        if len(batch) == _TEXT_BATCH:
            yield from (np.asarray(ids, np.int64) for ids in tokenizer(batch, add_special_tokens=False)["input_ids"])
            batch = []
    if batch:
        yield from (np.asarray(ids, np.int64) for ids in tokenizer(batch, add_special_tokens=False)["input_ids"])


def conversation_sequences(path: Path, tokenizer, options: CorpusOptions) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, assistant mask) of each conversation rendered through the target's chat template."""
    chat = ChatTokenizer(tokenizer, ChatTemplateConfig(max_length=None, enable_thinking=options.enable_thinking))
    for index, conversation in enumerate(read_conversations(path, unique_ids=False)):
        if options.limit is not None and index >= options.limit:
            return
        tokenized = chat.tokenize(conversation)
        yield tokenized.input_ids, tokenized.loss_mask


def build_ngram_drafter(
    inputs: list[str | Path],
    tokenizer,
    order: int,
    options: CorpusOptions = CorpusOptions(),
    min_count: int = 1,
    tokenizer_name: str = "",
    progress=None,
) -> NgramDrafter:
    """Count every corpus in `inputs` with `tokenizer` and keep each context's most frequent continuation."""
    counter = NgramCounter(order, len(tokenizer))
    corpora = []
    for path in map(Path, inputs):
        kind = corpus_kind(path, options)
        before = (counter.sequences, counter.counted_tokens)
        if kind == "text":
            for ids in text_sequences(path, tokenizer, options):
                counter.add(ids)
                if progress is not None:
                    progress.update(1)
        else:
            for ids, mask in conversation_sequences(path, tokenizer, options):
                counter.add(ids, mask)
                if progress is not None:
                    progress.update(1)
        corpora.append(
            {
                "path": str(path),
                "kind": kind,
                "sequences": counter.sequences - before[0],
                "counted_tokens": counter.counted_tokens - before[1],
            }
        )
    if counter.counted_tokens == 0:
        names = [str(p) for p in inputs]
        raise ValueError(f"--input {names}: no tokens to count (empty corpora, or no assistant turns).")
    metadata = {
        "corpora": corpora,
        "min_count": min_count,
        "enable_thinking": options.enable_thinking,
        "counted_tokens": counter.counted_tokens,
        "vocab_sha256": vocab_sha256(tokenizer),
    }
    return counter.build(min_count, tokenizer_name, metadata)
