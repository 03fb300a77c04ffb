"""Run speculative decoding over an eval split and record per-request acceptance and speed."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from megatron_osprey.eval.prompts import EvalPrompt
from megatron_osprey.models.drafter.reference import ReferenceDrafter
from megatron_osprey.speculative import (
    DraftSession,
    ReferenceDraftSession,
    SpecConfig,
    TargetModel,
    speculative_generate,
    target_generate,
)
from megatron_osprey.speculative.batched import (
    BatchedHFTarget,
    batched_speculative_generate,
    batched_target_generate,
    cache_capacity,
    replay_speculative_generate,
    target_features,
)
from megatron_osprey.speculative.batched_draft import BatchedReferenceDraftSession
from megatron_osprey.speculative.ngram import NgramDrafter, NgramDraftSession


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
    # Drafter wall time and proposed tokens (the reference engine measures them; the batched ones do not).
    draft_seconds: float | None = None
    drafted_tokens: int | None = None

    @property
    def acceptance_length(self) -> float:
        return self.completion_tokens / max(self.verify_count, 1)

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "acceptance_length": self.acceptance_length,
            "tokens_per_s": self.completion_tokens / self.seconds if self.seconds > 0 else None,
        }


def make_session(drafter: ReferenceDrafter | NgramDrafter, target_vocab_size: int | None = None) -> DraftSession:
    """The draft session the benchmark drives (one per drafter; an n-gram one proposes over the target's ids)."""
    if isinstance(drafter, NgramDrafter):
        return NgramDraftSession(drafter, target_vocab_size)
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


def run_requests(
    target: TargetModel,
    session: DraftSession,
    prompts: list[EvalPrompt],
    spec: SpecConfig,
    verify_lossless: bool = False,
    progress=None,
    references: dict | None = None,
) -> list[RequestResult]:
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
        result = _request_result(prompt, out, seconds, progress, timed_drafting=True)
        if verify_lossless:
            if prompt.id not in references:
                _sync()
                start = time.perf_counter()
                expected = target_generate(
                    target, prompt.input_ids, spec.max_new_tokens, eos_token_ids=spec.eos_token_ids
                )
                _sync()
                references[prompt.id] = (expected, time.perf_counter() - start)
            expected, result.target_seconds = references[prompt.id]
            result.mismatch_at = first_mismatch(out.tokens, expected)
        results.append(result)
    return results


def _decode_in_groups(prompts: list[EvalPrompt], batch_size: int, decode) -> list[tuple]:
    """decode(group of prompts) -> SpecResults, over groups of `batch_size` prompts of similar length.

    Returns (prompt, SpecResult, seconds) in prompt order; seconds are the group's wall time shared out."""
    order = sorted(range(len(prompts)), key=lambda i: (prompts[i].input_ids.numel(), i))
    out: dict[int, tuple] = {}
    for start in range(0, len(order), batch_size):
        indices = order[start : start + batch_size]
        group = [prompts[i] for i in indices]
        _sync()
        began = time.perf_counter()
        results = decode(group)
        _sync()
        share = (time.perf_counter() - began) / len(group)
        out.update({i: (p, r, share) for i, p, r in zip(indices, group, results)})
    return [out[i] for i in range(len(prompts))]


def _request_result(prompt: EvalPrompt, out, seconds: float, progress, timed_drafting: bool = False) -> RequestResult:
    """One request's record; `timed_drafting`: the decoder timed its drafting alone (batch 1), so it is kept."""
    drafting = {"draft_seconds": out.draft_seconds, "drafted_tokens": out.drafted_tokens} if timed_drafting else {}
    result = RequestResult(
        prompt.id,
        int(prompt.input_ids.numel()),
        out.completion_tokens,
        out.verify_count,
        seconds,
        list(out.accept_lengths),
        output_ids=[int(t) for t in out.tokens],
        **drafting,
    )
    if progress is not None:
        progress.update(1)
        progress.set_postfix(al=f"{result.acceptance_length:.2f}")
    return result


def _target_references(
    model, aux: list[int], prompts: list[EvalPrompt], spec: SpecConfig, batch_size: int, references: dict
) -> None:
    """Target-only greedy outputs (and their amortized seconds) for the prompts not in `references` yet."""

    def decode(group):
        ids = [p.input_ids for p in group]
        target = BatchedHFTarget(model, aux, cache_capacity(ids, spec, 1))
        return batched_target_generate(target, ids, spec.max_new_tokens, spec.eos_token_ids)

    missing = [p for p in prompts if p.id not in references]
    references.update(
        {p.id: (tokens, seconds) for p, tokens, seconds in _decode_in_groups(missing, batch_size, decode)}
    )


def run_requests_batched(
    model,
    drafter: ReferenceDrafter,
    prompts: list[EvalPrompt],
    spec: SpecConfig,
    batch_size: int,
    verify_lossless: bool = False,
    progress=None,
    references: dict | None = None,
) -> list[RequestResult]:
    """run_requests with the batched greedy-chain engine: groups of `batch_size` prompts of similar length.

    Each request gets the same tokens and acceptance as with run_requests (up to floating-point
    reduction order); its seconds are its group's wall time divided among the group's requests.
    Target-only references are decoded batched too, grouped the same way.
    """
    references = {} if references is None else references
    aux = list(drafter.config.aux_layer_ids)

    def decode(group):
        ids = [p.input_ids for p in group]
        target = BatchedHFTarget(model, aux, cache_capacity(ids, spec, spec.steps + 1))
        session = BatchedReferenceDraftSession(drafter, cache_capacity(ids, spec, 2 * spec.steps + 1))
        return batched_speculative_generate(target, session, ids, spec)

    decoded = _decode_in_groups(prompts, batch_size, decode)
    if verify_lossless:
        _target_references(model, aux, prompts, spec, batch_size, references)
    results = []
    for prompt, out, seconds in decoded:
        result = _request_result(prompt, out, seconds, progress)
        if verify_lossless:
            expected, result.target_seconds = references[prompt.id]
            result.mismatch_at = first_mismatch(out.tokens, expected)
        results.append(result)
    return results


def run_requests_replayed(
    model,
    drafter: ReferenceDrafter,
    prompts: list[EvalPrompt],
    spec: SpecConfig,
    batch_size: int,
    progress=None,
    references: dict | None = None,
    features: dict | None = None,
) -> list[RequestResult]:
    """Acceptance by replaying the target's greedy output (replay_speculative_generate), `batch_size` rows at once.

    `references` (prompt id -> (target-only tokens, seconds)) and `features` ((prompt id, aux layers) ->
    the target's aux features over prompt + output) are caches shared by every drafter, so the target
    runs once per prompt. A request's seconds are its group's drafting time shared out; no verify
    forward runs, so they are not a decoding speed.
    """
    references = {} if references is None else references
    features = {} if features is None else features
    aux = list(drafter.config.aux_layer_ids)
    key = tuple(aux)
    _target_references(model, aux, prompts, spec, batch_size, references)

    def target_pass(group):
        sequences = [torch.cat((p.input_ids, torch.tensor(references[p.id][0][:-1], dtype=torch.long))) for p in group]
        target = BatchedHFTarget(model, aux, max(s.numel() for s in sequences))
        return [f.cpu() for f in target_features(target, sequences)]

    missing = [p for p in prompts if (p.id, key) not in features]
    features.update({(p.id, key): f for p, f, _ in _decode_in_groups(missing, batch_size, target_pass)})

    def decode(group):
        session = BatchedReferenceDraftSession(
            drafter, cache_capacity([p.input_ids for p in group], spec, 2 * spec.steps + 1)
        )
        return replay_speculative_generate(
            session,
            [p.input_ids for p in group],
            [references[p.id][0] for p in group],
            [features[(p.id, key)] for p in group],
            spec,
        )

    results = []
    for prompt, out, seconds in _decode_in_groups(prompts, batch_size, decode):
        result = _request_result(prompt, out, seconds, progress)
        result.target_seconds = references[prompt.id][1]
        results.append(result)
    return results
