"""A draft-session test double that recomputes each proposal from the whole token sequence."""

from __future__ import annotations

import torch

from megatron_osprey.speculative import DraftSession


class RecomputeSession(DraftSession):
    """No cache: every call rebuilds the drafted sequence (the committed tokens plus the tree path
    to a node) and asks `_logits(seq)` for the next-token logits, which a subclass defines."""

    def __init__(self):
        self.seq: list[int] = []
        self.nodes: list[tuple[int, int]] = []  # (parent node or -1, token) per expanded node this round

    def _logits(self, seq: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def _path(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            parent, token = self.nodes[node]
            path.insert(0, token)
            node = parent
        return path

    def start(self, prompt_ids, first_token, aux):
        self.seq, self.nodes = prompt_ids.tolist() + [first_token], []
        return self._logits(self.seq)

    def extend(self, tokens, aux):
        self.seq, self.nodes = self.seq + tokens.tolist(), []
        return self._logits(self.seq)

    def expand(self, parents, tokens):
        out = []
        for parent, token in zip(parents, tokens.tolist()):
            out.append(self._logits(self.seq + self._path(parent) + [token]))
            self.nodes.append((parent, token))
        return torch.stack(out)

    def end_round(self):
        self.nodes = []


class ScriptedSession(RecomputeSession):
    """A draft session that proposes the reference continuation, except at every `miss`-th position.

    It costs no model work and makes the real target accept several drafts per round and reject the
    rest, so verify, tree masks and KV-cache commits are exercised with multi-token acceptance (the
    adapted drafter at initialization, a 2-layer logit lens of SmolLM2, gets none accepted)."""

    def __init__(self, script: list[int], vocab: int, miss: int = 7):
        super().__init__()
        self.script, self.vocab, self.miss = script, vocab, miss

    def _logits(self, seq):
        logits = torch.zeros(self.vocab)
        n = len(seq)
        right = self.script[n] if n < len(self.script) and seq == self.script[:n] else 0
        # A miss proposes two wrong tokens, so the chain and the tree both get a rejection there.
        first, second = (
            ((right + 1) % self.vocab, (right + 2) % self.vocab)
            if n % self.miss == 0
            else (right, (right + 1) % self.vocab)
        )
        logits[first], logits[second] = 10.0, 5.0
        return logits
