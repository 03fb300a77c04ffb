"""Pack tokenized conversations into fixed-length rows with per-document boundaries.

Each row carries ``document_ids`` (0..n-1 per row, -1 on padding), ``position_ids``
restarting at 0 for every document, and ``cu_seqlens`` (cumulative document lengths,
THD style). When a row is padded, the padding forms one extra trailing segment so that
``cu_seqlens[-1] == seq_length`` always holds, as THD attention kernels expect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from megatron_osprey.data.chat_template import TokenizedConversation

PAD_DOCUMENT_ID = -1


@dataclass(frozen=True)
class PackingConfig:
    """Row length, pad id and strategy.

    ``mode="pack"`` puts several documents in a row, ``mode="pad"`` one document per row.
    ``algorithm="sequential"`` keeps input order (next row when the document does not fit);
    ``"first_fit"`` puts each document in the first open row with room (denser, reorders).
    """

    seq_length: int = 4096
    pad_token_id: int = 0
    mode: str = "pack"
    algorithm: str = "sequential"


@dataclass(frozen=True)
class PackedRow:
    """One fixed-length training row; all arrays have length ``seq_length`` except cu_seqlens."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    position_ids: np.ndarray
    document_ids: np.ndarray
    cu_seqlens: np.ndarray
    num_documents: int
    source_ids: tuple[str, ...]


def _validate(config: PackingConfig) -> None:
    if config.seq_length < 1:
        raise ValueError(f"seq_length must be positive, got {config.seq_length}.")
    if config.mode not in ("pack", "pad"):
        raise ValueError(f"Packing mode must be 'pack' or 'pad', got {config.mode!r}.")
    if config.algorithm not in ("sequential", "first_fit"):
        raise ValueError(f"Packing algorithm must be 'sequential' or 'first_fit', got {config.algorithm!r}.")


def _assign_rows(lengths: Sequence[int], config: PackingConfig) -> list[list[int]]:
    rows: list[list[int]] = []
    room: list[int] = []
    for index, length in enumerate(lengths):
        if config.mode == "pad":
            target = None
        elif config.algorithm == "sequential":
            target = len(rows) - 1 if rows and room[-1] >= length else None
        else:
            target = next((r for r, free in enumerate(room) if free >= length), None)
        if target is None:
            rows.append([])
            room.append(config.seq_length)
            target = len(rows) - 1
        rows[target].append(index)
        room[target] -= length
    return rows


def build_row(documents: Sequence[TokenizedConversation], config: PackingConfig) -> PackedRow:
    """Concatenate documents into one row of ``config.seq_length`` tokens, padding the tail."""
    length = config.seq_length
    input_ids = np.full(length, config.pad_token_id, dtype=np.int64)
    loss_mask = np.zeros(length, dtype=bool)
    position_ids = np.zeros(length, dtype=np.int64)
    document_ids = np.full(length, PAD_DOCUMENT_ID, dtype=np.int64)
    boundaries = [0]
    for doc_index, doc in enumerate(documents):
        start, n = boundaries[-1], len(doc)
        if start + n > length:
            raise ValueError(f"Documents do not fit in seq_length {length} (conversation {doc.id!r}).")
        input_ids[start : start + n] = doc.input_ids
        loss_mask[start : start + n] = doc.loss_mask
        position_ids[start : start + n] = np.arange(n)
        document_ids[start : start + n] = doc_index
        boundaries.append(start + n)
    used = boundaries[-1]
    # Padding positions count up from 0 like a document of their own; the segment keeps
    # THD kernels' total length equal to the row length.
    position_ids[used:] = np.arange(length - used)
    if used < length:
        boundaries.append(length)
    return PackedRow(
        input_ids=input_ids,
        loss_mask=loss_mask,
        position_ids=position_ids,
        document_ids=document_ids,
        cu_seqlens=np.asarray(boundaries, dtype=np.int32),
        num_documents=len(documents),
        source_ids=tuple(d.id for d in documents),
    )


def pack_conversations(documents: Iterable[TokenizedConversation], config: PackingConfig) -> list[PackedRow]:
    """Pack (or pad) tokenized conversations into fixed-length rows."""
    _validate(config)
    documents = list(documents)
    for doc in documents:
        if len(doc) > config.seq_length:
            raise ValueError(
                f"Conversation {doc.id!r} has {len(doc)} tokens, more than seq_length {config.seq_length}; "
                "tokenize with ChatTemplateConfig.max_length <= seq_length."
            )
        if len(doc) == 0:
            raise ValueError(f"Conversation {doc.id!r} has no tokens.")
    assignment = _assign_rows([len(d) for d in documents], config)
    return [build_row([documents[i] for i in row], config) for row in assignment]


def block_diagonal_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Return a bool mask [..., L, L], True where query i may attend key j (same document, j <= i)."""
    same_document = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)
    length = document_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=document_ids.device).tril()
    return same_document & causal


def megatron_attention_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Return Megatron's mask convention [B, 1, L, L] from document ids [B, L]: True means masked out."""
    return ~block_diagonal_causal_mask(document_ids).unsqueeze(1)


def collate_rows(rows: Sequence[PackedRow]) -> dict[str, torch.Tensor]:
    """Stack rows into a batch; ``cu_seqlens`` are offset per row and flattened for THD kernels."""
    if not rows:
        raise ValueError("collate_rows needs at least one row.")
    length = rows[0].input_ids.shape[0]
    cu = [np.asarray([0], dtype=np.int32)]
    for b, row in enumerate(rows):
        if row.input_ids.shape[0] != length:
            raise ValueError("All packed rows in a batch must have the same seq_length.")
        cu.append(row.cu_seqlens[1:] + b * length)
    return {
        "tokens": torch.from_numpy(np.stack([r.input_ids for r in rows])),
        "loss_mask": torch.from_numpy(np.stack([r.loss_mask for r in rows])),
        "position_ids": torch.from_numpy(np.stack([r.position_ids for r in rows])),
        "document_ids": torch.from_numpy(np.stack([r.document_ids for r in rows])),
        "cu_seqlens": torch.from_numpy(np.concatenate(cu).astype(np.int32)),
    }
