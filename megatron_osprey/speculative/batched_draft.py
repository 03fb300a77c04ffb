"""The drafter side of the batched chain engine (``batched.py``): B rows drafted and extended together.

A BatchedDraftSession starts from every row's prompt, drafts a greedy chain per row, and commits each
row's accepted tokens and bonus. RowwiseDraftSession wraps any batch-1 DraftSession per row;
BatchedReferenceDraftSession batches a ReferenceDrafter's forwards over one preallocated KV cache
(SlotKVCache) whose slots are written for every row alike, with a per-row validity mask, the same
scheme as the batched target.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from megatron_osprey.models.drafter.reference import ReferenceDrafter

from .config import SpecConfig
from .tree import build_chain


class BatchedDraftSession(ABC):
    """The drafter side of the batched engine; logits are over the target vocabulary."""

    @abstractmethod
    def start(self, prompts: list[torch.Tensor], first_tokens: list[int], aux: list[torch.Tensor]) -> torch.Tensor:
        """Reset; commit each row's prompt rows and first token; return root logits [B, V]."""

    @abstractmethod
    def draft(self, root_logits: torch.Tensor, steps: int) -> torch.Tensor:
        """A greedy chain of `steps` tokens per row [B, steps], drafted from root logits [B, V]."""

    @abstractmethod
    def extend(self, tokens: list[list[int]], aux: list[torch.Tensor]) -> torch.Tensor:
        """Forget the chain; commit each row's new tokens with their aux [m_b, F]; return root logits [B, V]."""

    @abstractmethod
    def select(self, rows: list[int]) -> None:
        """Keep only these rows."""


class RowwiseDraftSession(BatchedDraftSession):
    """Any batch-1 DraftSession per row behind the batched interface (no batching on the drafter side)."""

    def __init__(self, make_session):
        self.make_session = make_session  # () -> DraftSession, one per row
        self.rows: list = []

    def start(self, prompts, first_tokens, aux):
        """Start one session per row."""
        self.rows = [self.make_session() for _ in prompts]
        return torch.stack([s.start(p, int(f), a) for s, p, f, a in zip(self.rows, prompts, first_tokens, aux)])

    def draft(self, root_logits, steps):
        """Each row's build_chain."""
        cfg = SpecConfig(steps=steps, topk=1)
        chains = []
        for session, logits in zip(self.rows, root_logits):
            chains.append(build_chain(session, logits, cfg, None).tokens)
            session.end_round()
        return torch.tensor(chains, dtype=torch.long)

    def extend(self, tokens, aux):
        """Each row's extend."""
        return torch.stack([s.extend(torch.tensor(t), a) for s, t, a in zip(self.rows, tokens, aux)])

    def select(self, rows):
        """Keep these rows' sessions."""
        self.rows = [self.rows[b] for b in rows]


class SlotKVCache:
    """The drafter's preallocated KV cache (ReferenceDrafter's cache interface: length, layer(i), append)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.used: list[int] = []

    @property
    def length(self) -> int:
        """Slots written so far."""
        return self.used[0] if self.used else 0

    def layer(self, i: int):
        """(keys, values) of layer i's used slots, or None before the first write."""
        if i >= len(self.keys):
            return None
        return self.keys[i][:, :, : self.used[i]], self.values[i][:, :, : self.used[i]]

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new slots for layer i."""
        if i == len(self.keys):
            b, h, _, d = k.shape
            self.keys.append(k.new_zeros(b, h, self.capacity, d))
            self.values.append(v.new_zeros(b, h, self.capacity, v.shape[-1]))
            self.used.append(0)
        n = k.shape[2]
        if self.used[i] + n > self.capacity:
            raise RuntimeError(f"drafter KV cache is full ({self.capacity} slots); raise its capacity.")
        self.keys[i][:, :, self.used[i] : self.used[i] + n] = k
        self.values[i][:, :, self.used[i] : self.used[i] + n] = v
        self.used[i] += n

    def select(self, index: torch.Tensor) -> None:
        """Keep these batch rows."""
        self.keys = [k[index] for k in self.keys]
        self.values = [v[index] for v in self.values]


class BatchedReferenceDraftSession(BatchedDraftSession):
    """BatchedDraftSession over a ReferenceDrafter: the batch-1 session's rows, positions and masks per row.

    Drafter row p reads token x_{p+1} with the target's aux feature f_p and sits at position p; a chain
    node drafted at depth d reads its parent's pre-norm hidden and sits at position committed - 1 + d.
    """

    def __init__(self, drafter: ReferenceDrafter, capacity: int):
        self.drafter = drafter.eval()
        self.capacity = capacity
        self.dtype = next(drafter.parameters()).dtype
        self.device = drafter.embed_tokens.weight.device

    def _run(self, ids, positions, new_valid, last, aux=None, g=None, chain_from=None):
        """Run ids [B, T] as new slots; returns target-vocab logits at column `last` [B] and all hiddens."""
        b, t = ids.shape
        n = self.cache.length
        old = self.valid[:, :n].clone()
        if chain_from is not None:  # this round's chain slots so far are the querying node's ancestors
            old[:, chain_from:] = True
        causal = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
        own = causal[None] & (new_valid[:, None, :] | torch.eye(t, dtype=torch.bool, device=self.device))
        allowed = torch.cat((old[:, None, :].expand(b, t, n), own), dim=2)
        logits, hidden = self.drafter(
            ids.to(self.device),
            aux_hidden=aux,
            g=g,
            position_ids=positions.to(self.device),
            kv_cache=self.cache,
            allowed=allowed,
            logits_rows=last.to(self.device),
        )
        return self.drafter.target_logits(logits[:, 0]), hidden

    def _commit_block(self, tokens: list[list[int]], aux: list[torch.Tensor]) -> torch.Tensor:
        counts = torch.tensor([len(t) for t in tokens])
        b, t = len(tokens), int(counts.max())
        ids = torch.zeros(b, t, dtype=torch.long)
        feats = torch.zeros(b, t, aux[0].shape[-1], dtype=self.dtype, device=self.device)
        for row, (row_tokens, row_aux) in enumerate(zip(tokens, aux)):
            ids[row, : len(row_tokens)] = torch.tensor(row_tokens)
            feats[row, : len(row_tokens)] = row_aux.to(device=self.device, dtype=self.dtype)
        new_valid = (torch.arange(t)[None] < counts[:, None]).to(self.device)
        positions = self.committed[:, None] + torch.arange(t)[None]
        start = self.cache.length
        logits, hidden = self._run(ids, positions, new_valid, counts - 1, aux=feats)
        self.valid[:, start : start + t] = new_valid
        self.committed += counts
        self.root_hidden = hidden[torch.arange(b), (counts - 1).to(self.device)]
        return logits

    @torch.no_grad()
    def start(self, prompts, first_tokens, aux):
        """Reset and prefill every row."""
        self.cache = SlotKVCache(self.capacity)
        self.valid = torch.zeros(len(prompts), self.capacity, dtype=torch.bool, device=self.device)
        self.committed = torch.zeros(len(prompts), dtype=torch.long)
        tokens = [p[1:].tolist() + [int(first)] for p, first in zip(prompts, first_tokens)]
        return self._commit_block(tokens, aux)

    @torch.no_grad()
    def draft(self, root_logits, steps):
        """Greedy chain: token d from the logits of depth d - 1 (the root's for d = 1)."""
        b = root_logits.shape[0]
        chain_from = self.cache.length
        drafted = [root_logits.argmax(-1).cpu()]
        g = self.root_hidden
        for depth in range(1, steps):
            positions = (self.committed - 1 + depth)[:, None]
            last = torch.zeros(b, dtype=torch.long)
            logits, hidden = self._run(
                drafted[-1][:, None],
                positions,
                torch.ones(b, 1, dtype=torch.bool, device=self.device),
                last,
                g=g[:, None],
                chain_from=chain_from,
            )
            g = hidden[:, 0]
            drafted.append(logits.argmax(-1).cpu())
        return torch.stack(drafted, dim=1)

    @torch.no_grad()
    def extend(self, tokens, aux):
        """Commit each row's accepted tokens and bonus (the chain's slots stay invalid)."""
        return self._commit_block(tokens, aux)

    def select(self, rows):
        """Keep only these rows."""
        index = torch.as_tensor(rows, dtype=torch.long)
        self.cache.select(index.to(self.device))
        self.valid = self.valid[index.to(self.device)]
        self.committed = self.committed[index]
        self.root_hidden = self.root_hidden[index.to(self.device)]
