"""Acceptance of a draft tree against one target forward: greedy and lossless sampling.

Sampling walks down from the root. At each node it tries the children in
order: child x proposed from q is accepted with probability min(1, p(x)/q(x));
on rejection p <- normalize(max(p - q, 0)) and the next sibling is tried
(recursive rejection sampling, SpecInfer/EAGLE). A deterministic proposal is a
one-hot q, so this accepts x with probability p(x) and then zeroes p(x).
When no child is accepted the bonus token is drawn from the remaining p.
Either way the emitted token has exactly the target's distribution.
"""

from __future__ import annotations

import torch

from .tree import DraftTree


def accept_greedy(tree: DraftTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Longest path whose tokens are the target's argmax; returns (node path, bonus token)."""
    path, node = [], -1
    while True:
        best = int(torch.argmax(target_logits[node + 1]))
        match = next((c for c in tree.children(node) if tree.tokens[c] == best), None)
        if match is None:
            return path, best
        path.append(match)
        node = match


def accept_sampling(
    tree: DraftTree, target_logits: torch.Tensor, temperature: float, generator: torch.Generator
) -> tuple[list[int], int]:
    """Recursive rejection sampling over siblings; returns (node path, bonus token)."""
    path, node = [], -1
    while True:
        p = torch.softmax(target_logits[node + 1].double() / temperature, dim=-1)
        accepted = None
        for child in tree.children(node):
            token, q = tree.tokens[child], tree.proposals[child]
            if q is None:
                q = torch.zeros_like(p)
                q[token] = 1.0
            ratio = p[token] / q[token] if q[token] > 0 else 0.0
            if torch.rand((), generator=generator, dtype=torch.float64) < ratio:
                accepted = child
                break
            residual = torch.clamp(p - q, min=0)
            # p == q up to rounding leaves no residual mass; p itself is then the exact answer.
            p = residual / residual.sum() if residual.sum() > 0 else p
        if accepted is None:
            return path, int(torch.multinomial(p.float().cpu(), 1, generator=generator))  # the CPU generator's draw
        path.append(accepted)
        node = accepted
