"""Draft construction: a chain (topk=1) or the EAGLE-2 dynamic tree (topk>1).

Tree, as SGLang builds it: the root's top-k children form level 1; each later
level expands the current k frontier nodes, scores their k*k top-k children by
cumulative drafter log-prob, and keeps the best k as the next frontier. From
all scored nodes the best ``draft_tokens - 1`` are verified. A child never
scores above its parent and ties rank the shallower node first, so the kept
set always contains every kept node's ancestors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import SpecConfig
from .draft_session import DraftSession


@dataclass
class DraftTree:
    """Draft nodes in verify order (parents before children); parent -1 is the root."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    # The distribution each token was sampled from (target vocab), or None for a
    # deterministic proposal (top-k / argmax), which verification treats as one-hot.
    proposals: list[torch.Tensor | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, proposal: torch.Tensor | None = None) -> int:
        """Append a node; returns its index."""
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.proposals.append(proposal)
        return len(self.tokens) - 1

    def children(self, node: int) -> list[int]:
        """Children of node (-1 = root) in proposal order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def verify_inputs(self, root_token: int):
        """(tokens [m], depths [m], allowed [m, m]) for the target: root row 0, node i at row i + 1."""
        m = len(self) + 1
        tokens = torch.tensor([root_token, *self.tokens], dtype=torch.long)
        depths = torch.tensor([0, *self.depths], dtype=torch.long)
        allowed = torch.zeros(m, m, dtype=torch.bool)
        allowed[:, 0] = True
        for i in range(len(self)):
            node = i
            while node >= 0:
                allowed[i + 1, node + 1] = True
                node = self.parents[node]
        return tokens, depths, allowed


def _proposal_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.double() / temperature, dim=-1)


def build_chain(session: DraftSession, root_logits: torch.Tensor, cfg: SpecConfig, generator) -> DraftTree:
    """Draft steps tokens one after another (argmax, or sampled when cfg says so)."""
    tree, logits, session_id = DraftTree(), root_logits, -1
    sample = cfg.temperature > 0 and cfg.sample_drafts
    for level in range(cfg.steps):
        # A row of -inf is a drafter with nothing to propose (an n-gram drafter's unseen context): stop.
        if sample:
            if bool(torch.isneginf(logits).all()):
                break
            probs = _proposal_probs(logits, cfg.temperature)
            token = int(torch.multinomial(probs.float().cpu(), 1, generator=generator))  # the CPU generator's draw
            tree.add(token, level - 1, probs)
        else:
            token = int(torch.argmax(logits))
            if logits[token] == float("-inf"):  # the maximum is -inf: every entry is
                break
            tree.add(token, level - 1)
        if level < cfg.steps - 1:
            logits = session.expand([session_id], torch.tensor([token]))[0]
            session_id = level
    return tree


def build_tree(session: DraftSession, root_logits: torch.Tensor, cfg: SpecConfig) -> DraftTree:
    """EAGLE-2 dynamic tree with deterministic top-k proposals (see module docstring)."""
    k = cfg.topk
    # Scored nodes: (score, depth, creation index, token, parent creation index)
    nodes: list[tuple[float, int, int, int, int]] = []
    session_ids: dict[int, int] = {}
    expanded = 0

    def add_children(parent: int, parent_score: float, depth: int, logits: torch.Tensor) -> list[int]:
        logp = torch.log_softmax(logits.double(), dim=-1)
        values, ids = logp.topk(k)
        new = []
        for v, t in zip(values.tolist(), ids.tolist()):
            if v == float("-inf"):  # outside the draft vocabulary
                continue
            nodes.append((parent_score + v, depth, len(nodes), t, parent))
            new.append(len(nodes) - 1)
        return new

    frontier = add_children(-1, 0.0, 1, root_logits)
    for depth in range(2, cfg.steps + 1):
        if not frontier:
            break
        parents = [session_ids.get(nodes[f][4], -1) for f in frontier]
        logits = session.expand(parents, torch.tensor([nodes[f][3] for f in frontier]))
        for f in frontier:
            session_ids[f] = expanded
            expanded += 1
        candidates = []
        for f, row in zip(frontier, logits):
            candidates += add_children(f, nodes[f][0], depth, row)
        frontier = sorted(candidates, key=lambda i: (-nodes[i][0], i))[:k]
    keep = sorted(range(len(nodes)), key=lambda i: (-nodes[i][0], nodes[i][1], i))[: cfg.draft_tokens - 1]
    keep.sort(key=lambda i: (nodes[i][1], -nodes[i][0], i))  # parents first, siblings by score
    position = {c: j for j, c in enumerate(keep)}
    tree = DraftTree()
    for c in keep:
        parent = nodes[c][4]
        tree.add(nodes[c][3], -1 if parent < 0 else position[parent])
    return tree


def build_draft(session: DraftSession, root_logits: torch.Tensor, cfg: SpecConfig, generator) -> DraftTree:
    """Chain when topk == 1, dynamic tree otherwise."""
    if cfg.topk == 1:
        return build_chain(session, root_logits, cfg, generator)
    return build_tree(session, root_logits, cfg)
