"""Run speculative decoding over an eval split and record per-request acceptance and speed."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from megatron_osprey.eval.prompts import EvalPrompt
from megatron_osprey.models.reference_drafter import ReferenceDrafter
from megatron_osprey.speculative.batched import (
    BatchedHFTarget,
    BatchedReferenceDraftSession,
    batched_speculative_generate,
    batched_target_generate,
    cache_capacity,
)
from megatron_osprey.speculative import (
    DraftSession,
    ReferenceDraftSession,
    SpecConfig,
    TargetModel,
    speculative_generate,
    target_generate,
)


@dataclass
class RequestResult:
    """One request's figures; AL = completion_tokens / verify_count (SGLang's spec_verify_ct)."""

    id: str
    prompt_tokens: int
    completion_tokens: int
    verify_count: int
    seconds: float
    accept_lengths: list[int] = field(default_factory=list)
    # --verify-lossless: index of the first token that differs from target-only greedy decoding, and the
    # seconds that target-only decoding took (the same prompt's, shared by every drafter).
    mismatch_at: int | None = None
    target_seconds: float | None = None
    output_ids: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        return self.completion_tokens / max(self.verify_count, 1)

    def to_dict(self) -> dict:
        return {**asdict(self), "acceptance_length": self.acceptance_length,
                "tokens_per_s": self.completion_tokens / self.seconds if self.seconds > 0 else None}


def make_session(drafter: ReferenceDrafter) -> DraftSession:
    """The draft session the benchmark drives (one per drafter)."""
    return ReferenceDraftSession(drafter)


def first_mismatch(got: list[int], expected: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts), or None when equal."""
    for i, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            return i
    return None if len(got) == len(expected) else min(len(got), len(expected))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_requests(target: TargetModel, session: DraftSession, prompts: list[EvalPrompt], spec: SpecConfig,
                 verify_lossless: bool = False, progress=None, references: dict | None = None) -> list[RequestResult]:
    """Decode every prompt speculatively (batch 1); optionally compare with target-only greedy decoding.

    `references` caches target-only decodes by prompt id across calls (the target's greedy output of a
    prompt does not depend on the drafter).
    """
    references = {} if references is None else references
    results = []
    for prompt in prompts:
        _sync()
        start = time.perf_counter()
        out = speculative_generate(target, session, prompt.input_ids, spec)
        _sync()
        seconds = time.perf_counter() - start
        result = RequestResult(prompt.id, int(prompt.input_ids.numel()), out.completion_tokens, out.verify_count,
                               seconds, list(out.accept_lengths), output_ids=[int(t) for t in out.tokens])
        if verify_lossless:
            if prompt.id not in references:
                _sync()
                start = time.perf_counter()
                expected = target_generate(target, prompt.input_ids, spec.max_new_tokens,
                                           eos_token_ids=spec.eos_token_ids)
                _sync()
                references[prompt.id] = (expected, time.perf_counter() - start)
            expected, result.target_seconds = references[prompt.id]
            result.mismatch_at = first_mismatch(out.tokens, expected)
        results.append(result)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(al=f"{result.acceptance_length:.2f}")
    return results


def run_requests_batched(model, drafter: ReferenceDrafter, prompts: list[EvalPrompt], spec: SpecConfig,
                         batch_size: int, verify_lossless: bool = False, progress=None,
                         references: dict | None = None) -> list[RequestResult]:
    """run_requests with the batched greedy-chain engine: groups of `batch_size` prompts of similar length.

    Each request gets the same tokens and acceptance as with run_requests (up to floating-point
    reduction order); its seconds are its group's wall time divided among the group's requests.
    Target-only references are decoded batched too, grouped the same way.
    """
    references = {} if references is None else references
    aux = list(drafter.config.aux_layer_ids)
    order = sorted(range(len(prompts)), key=lambda i: (prompts[i].input_ids.numel(), i))
    results: dict[int, RequestResult] = {}
    for start in range(0, len(order), batch_size):
        group = [prompts[i] for i in order[start: start + batch_size]]
        ids = [p.input_ids for p in group]
        _sync()
        began = time.perf_counter()
        target = BatchedHFTarget(model, aux, cache_capacity(ids, spec, spec.steps + 1))
        session = BatchedReferenceDraftSession(drafter, cache_capacity(ids, spec, 2 * spec.steps + 1))
        outs = batched_speculative_generate(target, session, ids, spec)
        del target, session
        _sync()
        share = (time.perf_counter() - began) / len(group)
        missing = [p for p in group if p.id not in references]
        if verify_lossless and missing:
            _sync()
            began = time.perf_counter()
            missing_ids = [p.input_ids for p in missing]
            target = BatchedHFTarget(model, aux, cache_capacity(missing_ids, spec, 1))
            expected = batched_target_generate(target, missing_ids, spec.max_new_tokens, spec.eos_token_ids)
            _sync()
            target_share = (time.perf_counter() - began) / len(missing)
            references.update({p.id: (e, target_share) for p, e in zip(missing, expected)})
        for index, prompt, out in zip(order[start: start + batch_size], group, outs):
            result = RequestResult(prompt.id, int(prompt.input_ids.numel()), out.completion_tokens, out.verify_count,
                                   share, list(out.accept_lengths), output_ids=[int(t) for t in out.tokens])
            if verify_lossless:
                expected, result.target_seconds = references[prompt.id]
                result.mismatch_at = first_mismatch(out.tokens, expected)
            results[index] = result
            if progress is not None:
                progress.update(1)
                progress.set_postfix(al=f"{result.acceptance_length:.2f}")
    return [results[i] for i in range(len(prompts))]
