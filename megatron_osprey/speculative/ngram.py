"""An n-gram drafter over the target's tokenizer: the most frequent continuation of each context, with back-off.

Convention: a table of order k maps a context of the k tokens just before a position to the token at that
position. A drafter of order N keeps tables for k = N-1 .. 1 and proposes from the longest context it has
seen; a history none of them knows gets no proposal (drafting stops there).

Contexts are stored as 64-bit hashes, sorted for binary search, beside the winning next id, its count and
the context's total count (numpy arrays in ``ngram.npz``; ``config.json`` says what the directory holds).
Two distinct contexts of one order share a hash with probability about n^2 / 2^65 for n contexts, which
can only cost acceptance, never correctness: verification is by the target.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from megatron_osprey.base.atomic_io import atomic_path, write_json_atomic
from megatron_osprey.models.drafter.reference import CONFIG_NAME

from .draft_session import DraftSession

NGRAM_FORMAT_TAG = "megatron_osprey.ngram_drafter/1"
TABLES_NAME = "ngram.npz"

# A multiply-xorshift hash of the context read newest token first, so the hash of k tokens extends the
# hash of k - 1; numpy (counting) and Python ints (lookup) compute the same value.
_SEED = 0xCBF29CE484222325
_MULTIPLIER = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
# Pairs reduced to (context, next, count) at a time while counting: bounds memory on a large corpus.
_CHUNK_PAIRS = 1 << 23


def _mix(h: int, token: int) -> int:
    h = ((h ^ (token + 1)) * _MULTIPLIER) & _MASK
    return h ^ (h >> 29)


def _mix_array(h: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    h = (h ^ (tokens.astype(np.uint64) + np.uint64(1))) * np.uint64(_MULTIPLIER)  # wraps modulo 2^64
    return h ^ (h >> np.uint64(29))


def context_hashes(history: Sequence[int], longest: int) -> list[int]:
    """Hashes of the last 1, 2, .., min(longest, len(history)) tokens of `history`."""
    out, h = [], _SEED
    for token in reversed(history[len(history) - min(longest, len(history)) :]):
        h = _mix(h, int(token))
        out.append(h)
    return out


@dataclass
class NgramTable:
    """Contexts of one length: sorted hashes, the most frequent next id, its count and the context's count."""

    keys: np.ndarray  # uint64, sorted, unique
    next_ids: np.ndarray  # int64
    counts: np.ndarray  # int64: how often next_ids followed the context
    totals: np.ndarray  # int64: how often the context occurred before a counted token

    def find(self, key: int) -> int | None:
        """Row of `key`, or None."""
        row = int(np.searchsorted(self.keys, np.uint64(key)))
        return row if row < self.keys.size and int(self.keys[row]) == key else None


@dataclass
class NgramDrafter:
    """Back-off n-gram tables (``tables[k - 1]`` holds contexts of k tokens) and what they were made from."""

    order: int
    vocab_size: int
    tables: list[NgramTable]
    tokenizer: str = ""
    metadata: dict = field(default_factory=dict)

    def lookup(self, context: Sequence[int]) -> tuple[int, int, int] | None:
        """(next id, its count, the context's count) for exactly this context, or None when unseen."""
        k = len(context)
        if not 1 <= k < self.order:
            raise ValueError(
                f"an order-{self.order} n-gram drafter has contexts of 1..{self.order - 1} tokens, got {k}."
            )
        table = self.tables[k - 1]
        row = table.find(context_hashes(context, k)[-1])
        if row is None:
            return None
        return int(table.next_ids[row]), int(table.counts[row]), int(table.totals[row])

    def predict(self, history: Sequence[int]) -> int | None:
        """The next token after `history`: the longest known context wins; None when no context is known."""
        hashes = context_hashes(history, self.order - 1)
        for k in range(len(hashes), 0, -1):
            table = self.tables[k - 1]
            row = table.find(hashes[k - 1])
            if row is not None:
                return int(table.next_ids[row])
        return None

    def draft(self, history: Sequence[int], steps: int) -> list[int]:
        """Up to `steps` tokens, each the prediction after the history and the tokens drafted so far."""
        history, out = list(history), []
        for _ in range(steps):
            token = self.predict(history)
            if token is None:
                break
            history.append(token)
            out.append(token)
        return out

    def save(self, directory: str | Path) -> None:
        """ngram.npz (the tables) and config.json (written last: the directory is complete once it exists)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        arrays = {}
        for k, table in enumerate(self.tables, start=1):
            arrays |= {
                f"keys_{k}": table.keys,
                f"next_{k}": table.next_ids.astype(np.int32),
                f"count_{k}": table.counts.astype(np.uint32),
                f"total_{k}": table.totals.astype(np.uint32),
            }
        with atomic_path(directory / TABLES_NAME) as tmp:
            with open(tmp, "wb") as handle:
                np.savez(handle, **arrays)
        config = {
            "format": NGRAM_FORMAT_TAG,
            "order": self.order,
            "vocab_size": self.vocab_size,
            "tokenizer": self.tokenizer,
            "contexts": {str(k): int(t.keys.size) for k, t in enumerate(self.tables, start=1)},
            **self.metadata,
        }
        write_json_atomic(directory / CONFIG_NAME, config)

    @classmethod
    def load(cls, directory: str | Path) -> NgramDrafter:
        """Read a directory that save() wrote (no pickle: plain arrays only)."""
        directory = Path(directory)
        config = json.loads((directory / CONFIG_NAME).read_text())
        if config.get("format") != NGRAM_FORMAT_TAG:
            raise ValueError(f"{directory / CONFIG_NAME} is not an n-gram drafter config (format {NGRAM_FORMAT_TAG}).")
        if not (directory / TABLES_NAME).is_file():
            raise FileNotFoundError(f"{directory}: {TABLES_NAME} is missing beside its n-gram config.json.")
        order = int(config["order"])
        with np.load(directory / TABLES_NAME, allow_pickle=False) as data:
            tables = [
                NgramTable(
                    data[f"keys_{k}"],
                    data[f"next_{k}"].astype(np.int64),
                    data[f"count_{k}"].astype(np.int64),
                    data[f"total_{k}"].astype(np.int64),
                )
                for k in range(1, order)
            ]
        known = ("format", "order", "vocab_size", "tokenizer", "contexts")
        metadata = {k: v for k, v in config.items() if k not in known}
        return cls(order, int(config["vocab_size"]), tables, config.get("tokenizer", ""), metadata)


def is_ngram_dir(path: str | Path) -> bool:
    """True for a directory whose config.json says it holds an n-gram drafter."""
    config = Path(path) / CONFIG_NAME
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("format") == NGRAM_FORMAT_TAG
    except (ValueError, AttributeError):
        return False


def _reduce(hashes: np.ndarray, nexts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, ...]:
    """Sum counts of equal (context, next) pairs; returns the distinct pairs sorted by context then next."""
    if not hashes.size:
        return hashes, nexts, counts
    order = np.lexsort((nexts, hashes))
    hashes, nexts, counts = hashes[order], nexts[order], counts[order]
    starts = np.flatnonzero(np.r_[True, (hashes[1:] != hashes[:-1]) | (nexts[1:] != nexts[:-1])])
    return hashes[starts], nexts[starts], np.add.reduceat(counts, starts)


def _best(hashes: np.ndarray, nexts: np.ndarray, counts: np.ndarray, min_count: int) -> NgramTable:
    """Per context, the most frequent next id (ties: the smaller id); contexts below min_count dropped."""
    if not hashes.size:
        return NgramTable(hashes, nexts, counts, counts.copy())
    order = np.lexsort((nexts, -counts, hashes))
    hashes, nexts, counts = hashes[order], nexts[order], counts[order]
    starts = np.flatnonzero(np.r_[True, hashes[1:] != hashes[:-1]])
    totals = np.add.reduceat(counts, starts)
    keep = counts[starts] >= min_count
    starts = starts[keep]
    return NgramTable(hashes[starts], nexts[starts].astype(np.int64), counts[starts], totals[keep])


class NgramCounter:
    """Counts (context, next) pairs of every context length over token sequences, then keeps the winners."""

    def __init__(self, order: int, vocab_size: int):
        if order < 2:
            raise ValueError(f"--order must be >= 2 (an n-gram has at least one context token), got {order}.")
        self.order, self.vocab_size = order, vocab_size
        self._pending: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(order - 1)]
        self._pending_pairs = 0
        self._reduced = [(np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.int64))] * (order - 1)
        self.sequences = 0
        self.counted_tokens = 0

    def add(self, ids: Sequence[int] | np.ndarray, targets: np.ndarray | None = None) -> None:
        """Count one sequence; `targets` (bool per position, default all) marks the tokens to predict."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token ids must be in 0..{self.vocab_size - 1}, got {ids.min()}..{ids.max()}.")
        targets = np.ones(ids.size, dtype=bool) if targets is None else np.asarray(targets, dtype=bool)
        self.sequences += 1
        self.counted_tokens += int(targets[1:].sum())
        h = np.full(ids.size, _SEED, dtype=np.uint64)
        for k in range(1, min(self.order, ids.size)):
            # h[i] now hashes ids[i-k .. i-1] (newest first) for every i >= k.
            h = _mix_array(h[1:], ids[: ids.size - k])
            chosen = targets[k:]
            self._pending[k - 1].append((h[chosen], ids[k:][chosen]))
            self._pending_pairs += int(chosen.sum())
        if self._pending_pairs >= _CHUNK_PAIRS:
            self._flush()

    def _flush(self) -> None:
        for k, pending in enumerate(self._pending):
            if not pending:
                continue
            hashes = np.concatenate([self._reduced[k][0], *(p[0] for p in pending)])
            nexts = np.concatenate([self._reduced[k][1], *(p[1] for p in pending)])
            counts = np.concatenate([self._reduced[k][2], np.ones(sum(p[0].size for p in pending), np.int64)])
            self._reduced[k] = _reduce(hashes, nexts, counts)
        self._pending = [[] for _ in range(self.order - 1)]
        self._pending_pairs = 0

    def counts(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every distinct (context hash, next id, count) of context length k, sorted by hash then next id."""
        self._flush()
        return self._reduced[k - 1]

    def build(self, min_count: int = 1, tokenizer: str = "", metadata: dict | None = None) -> NgramDrafter:
        """The drafter: per context, its most frequent continuation (seen at least `min_count` times)."""
        if min_count < 1:
            raise ValueError(f"--min-count must be >= 1, got {min_count}.")
        tables = [_best(*self.counts(k), min_count) for k in range(1, self.order)]
        return NgramDrafter(self.order, self.vocab_size, tables, tokenizer, dict(metadata or {}))


def count_ngrams(
    sequences: Iterable[Sequence[int] | tuple[Sequence[int], np.ndarray]], order: int, vocab_size: int, **build
) -> NgramDrafter:
    """An NgramDrafter from token sequences (or (ids, targets) pairs); `build`: NgramCounter.build's keywords."""
    counter = NgramCounter(order, vocab_size)
    for item in sequences:
        if isinstance(item, tuple):
            counter.add(*item)
        else:
            counter.add(item)
    return counter.build(**build)


class NgramDraftSession(DraftSession):
    """A draft session over an NgramDrafter: chains only; no proposal is an all -inf row (the chain stops).

    Logits are 0 on the proposed token and -inf elsewhere, over `vocab_size` ids (the target's
    vocabulary, which may be padded beyond the tokenizer's); greedy and sampled verification both treat
    such a row as a deterministic proposal. Aux features are ignored.
    """

    def __init__(self, drafter: NgramDrafter, vocab_size: int | None = None):
        self.drafter = drafter
        self.vocab_size = drafter.vocab_size if vocab_size is None else int(vocab_size)
        if self.vocab_size < drafter.vocab_size:
            raise ValueError(
                f"the n-gram drafter's vocabulary ({drafter.vocab_size}) is larger than the target's "
                f"({self.vocab_size}); it was built with another tokenizer."
            )
        self.history: list[int] = []
        self.chain: list[int] = []

    def _logits(self, history: list[int]) -> torch.Tensor:
        logits = torch.full((self.vocab_size,), float("-inf"))
        token = self.drafter.predict(history)
        if token is not None:
            logits[token] = 0.0
        return logits

    def start(self, prompt_ids, first_token, aux):
        """Reset to the prompt and the first generated token."""
        self.history, self.chain = [int(t) for t in prompt_ids.tolist()] + [int(first_token)], []
        return self._logits(self.history)

    def extend(self, tokens, aux):
        """Commit the verified tokens."""
        self.chain = []
        self.history.extend(int(t) for t in tokens.tolist())
        return self._logits(self.history)

    def expand(self, parents, tokens):
        """Extend this round's chain by one token (a tree is refused)."""
        if len(parents) != 1 or parents[0] != len(self.chain) - 1:
            raise ValueError("n-gram drafters draft chains only: evaluate them with --topk 1.")
        self.chain.append(int(tokens[0]))
        return self._logits(self.history + self.chain)[None]

    def end_round(self):
        """Forget this round's chain."""
        self.chain = []
