"""Speculative-decoding settings and per-request results.

Draft-shape knobs follow SGLang's EAGLE flags exactly:

* ``steps`` (``--speculative-num-steps``): drafter forward depth, i.e. the
  deepest draft token sits ``steps`` positions after the last verified token.
* ``topk`` (``--speculative-eagle-topk``): branching per expanded node; 1 is a
  chain, >1 the EAGLE-2 dynamic tree.
* ``draft_tokens`` (``--speculative-num-draft-tokens``): tokens the target
  verifies per round *including* the root (the last verified token, whose KV
  the target does not have yet), so ``draft_tokens - 1`` drafted tokens and at
  most ``draft_tokens`` tokens gained per verify. SGLang forces
  ``steps + 1`` when ``topk == 1``; here that is the default and anything else
  is an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecConfig:
    """How to draft and verify (defaults: the paper's serving config)."""

    steps: int = 5
    topk: int = 1
    draft_tokens: int | None = None
    temperature: float = 0.0
    max_new_tokens: int = 256
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0
    # temperature > 0 and topk == 1: sample each draft token from the drafter
    # (standard speculative sampling). False proposes the drafter's argmax as
    # SGLang does; both are lossless. Trees always propose their top-k.
    sample_drafts: bool = True

    def __post_init__(self) -> None:
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)
        if self.steps < 1:
            raise ValueError(f"SpecConfig.steps must be >= 1, got {self.steps}.")
        if self.topk < 1:
            raise ValueError(f"SpecConfig.topk must be >= 1, got {self.topk}.")
        if self.topk == 1:
            if self.draft_tokens is None:
                self.draft_tokens = self.steps + 1
            if self.draft_tokens != self.steps + 1:
                raise ValueError(
                    f"SpecConfig.draft_tokens must equal steps + 1 = {self.steps + 1} when topk == 1 "
                    f"(SGLang's rule), got {self.draft_tokens}."
                )
        else:
            most = 1 + self.topk + (self.steps - 1) * self.topk**2
            if self.draft_tokens is None or not 2 <= self.draft_tokens <= most:
                raise ValueError(
                    f"SpecConfig.draft_tokens must be in 2..{most} for steps={self.steps}, topk={self.topk}, "
                    f"got {self.draft_tokens}."
                )
        if self.temperature < 0:
            raise ValueError(f"SpecConfig.temperature must be >= 0, got {self.temperature}.")
        if self.max_new_tokens < 1:
            raise ValueError(f"SpecConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}.")


@dataclass
class SpecResult:
    """One request: generated tokens, target verify forwards, tokens gained per verify.

    ``accept_lengths[i]`` counts the tokens verify i added to the output
    (accepted drafts + the target's bonus token, cut at EOS/max_new_tokens);
    the first token comes from prefill, so ``len(tokens) == 1 + sum(accept_lengths)``.
    """

    tokens: list[int]
    verify_count: int
    accept_lengths: list[int] = field(default_factory=list)
    # Wall time inside the drafter (prefill, commits and drafting) and the tokens it proposed: drafting
    # cost per token, which is what makes a cheap drafter worth its lower acceptance.
    draft_seconds: float = 0.0
    drafted_tokens: int = 0

    @property
    def completion_tokens(self) -> int:
        """Number of generated tokens."""
        return len(self.tokens)

    @property
    def acceptance_length(self) -> float:
        """AL = completion_tokens / verify_count (SGLang's definition; the prefill token counts)."""
        return self.completion_tokens / max(self.verify_count, 1)

    @property
    def draft_seconds_per_token(self) -> float | None:
        """Drafter wall time per proposed token (None when nothing was proposed)."""
        return self.draft_seconds / self.drafted_tokens if self.drafted_tokens else None


def acceptance_summary(results: list[SpecResult]) -> dict:
    """Mean per-request AL and pooled AL (total tokens / total verifies)."""
    if not results:
        raise ValueError("acceptance_summary needs at least one SpecResult.")
    verifies = sum(r.verify_count for r in results)
    return {
        "mean_acceptance_length": sum(r.acceptance_length for r in results) / len(results),
        "pooled_acceptance_length": sum(r.completion_tokens for r in results) / max(verifies, 1),
        "requests": len(results),
        "verify_count": verifies,
    }
