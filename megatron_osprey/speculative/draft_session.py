"""Drafter side of speculative decoding: committed rows plus a per-round draft tree.

Row convention (EAGLE): drafter row p reads token x_{p+1} with the target's
aux feature f_p (or, for tree rows, its parent row's pre-norm hidden) and
predicts x_{p+2}. A tree node drafted at depth d sits at position
``committed - 1 + d``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from megatron_osprey.models.drafter.reference import DrafterKVCache, ReferenceDrafter


class DraftSession(ABC):
    """What the engine needs from a drafter; logits are over the target vocabulary."""

    @abstractmethod
    def start(self, prompt_ids: torch.Tensor, first_token: int, aux: torch.Tensor) -> torch.Tensor:
        """Reset, commit rows for the prompt (aux [n, F]) and first generated token; return root logits [V]."""

    @abstractmethod
    def extend(self, tokens: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """Drop this round's tree, commit tokens [m] with aux [m, F]; return root logits [V]."""

    @abstractmethod
    def expand(self, parents: Sequence[int], tokens: torch.Tensor) -> torch.Tensor:
        """Add tree nodes (parent = id of an earlier expanded node, -1 = root); return their logits [k, V].

        New nodes get ids len(expanded so far) + 0..k-1.
        """

    @abstractmethod
    def end_round(self) -> None:
        """Forget this round's tree (roll the drafter cache back to the committed rows)."""


class ReferenceDraftSession(DraftSession):
    """DraftSession over a ReferenceDrafter with an explicit KV cache."""

    def __init__(self, drafter: ReferenceDrafter):
        self.drafter = drafter.eval()
        self.dtype = next(drafter.parameters()).dtype
        self.cache = DrafterKVCache()
        self.committed = 0
        self.root_hidden = None
        self.tree_hidden: list[torch.Tensor] = []
        self.tree_parent: list[int] = []
        self.tree_depth: list[int] = []

    @torch.no_grad()
    def start(self, prompt_ids, first_token, aux):
        """Reset and prefill the drafter."""
        self.cache, self.committed = DrafterKVCache(), 0
        tokens = torch.cat((prompt_ids[1:], torch.tensor([first_token], dtype=prompt_ids.dtype)))
        return self.extend(tokens, aux)

    @torch.no_grad()
    def extend(self, tokens, aux):
        """Commit rows (SGLang's draft extend)."""
        self.end_round()
        device = self.drafter.embed_tokens.weight.device
        logits, hidden = self.drafter(
            tokens.to(device)[None], aux_hidden=aux.to(device=device, dtype=self.dtype)[None], kv_cache=self.cache
        )
        self.committed += tokens.numel()
        self.root_hidden = hidden[0, -1]
        return self.drafter.target_logits(logits[0, -1])

    @torch.no_grad()
    def expand(self, parents, tokens):
        """Run new tree nodes with a tree attention mask."""
        k, tree = len(parents), len(self.tree_hidden)
        device = self.root_hidden.device
        g = torch.stack([self.root_hidden if p < 0 else self.tree_hidden[p] for p in parents])
        depths = [1 if p < 0 else self.tree_depth[p] + 1 for p in parents]
        allowed = torch.zeros(k, self.committed + tree + k, dtype=torch.bool, device=device)
        allowed[:, : self.committed] = True
        for j, p in enumerate(parents):
            allowed[j, self.committed + tree + j] = True
            while p >= 0:  # ancestors among earlier tree rows
                allowed[j, self.committed + p] = True
                p = self.tree_parent[p]
        positions = torch.tensor(depths, device=device) + self.committed - 1
        logits, hidden = self.drafter(
            tokens.to(device)[None], g=g[None], position_ids=positions[None], kv_cache=self.cache, allowed=allowed[None]
        )
        self.tree_hidden.extend(hidden[0])
        self.tree_parent.extend(parents)
        self.tree_depth.extend(depths)
        return self.drafter.target_logits(logits[0])

    def end_round(self):
        """Crop tree rows from the cache."""
        self.cache.crop(self.committed)
        self.tree_hidden, self.tree_parent, self.tree_depth = [], [], []
