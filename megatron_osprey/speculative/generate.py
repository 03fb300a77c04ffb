"""Speculative generation loop (batch 1) and the target-only baseline."""

from __future__ import annotations

import time

import torch

from megatron_osprey.models.target.decoding import TargetModel

from .config import SpecConfig, SpecResult
from .draft_session import DraftSession
from .tree import build_draft
from .verify import accept_greedy, accept_sampling


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    # The generator lives on the CPU: draw there, whatever the logits' device (the same draws on CPU and GPU).
    return int(torch.multinomial(probs.float().cpu(), 1, generator=generator))


def emit_tokens(out: list[int], new: list[int], cfg: SpecConfig) -> tuple[int, bool]:
    """Append tokens up to EOS (kept) or max_new_tokens; return (tokens added, finished)."""
    added = 0
    for token in new:
        out.append(token)
        added += 1
        if token in cfg.eos_token_ids or len(out) >= cfg.max_new_tokens:
            return added, True
    return added, False


def speculative_generate(
    target: TargetModel,
    drafter: DraftSession,
    prompt_ids: torch.Tensor,
    cfg: SpecConfig,
    generator: torch.Generator | None = None,
) -> SpecResult:
    """Generate with draft-then-verify; output distribution equals the target's (greedy: identical tokens)."""
    if generator is None:
        generator = torch.Generator().manual_seed(cfg.seed)
    prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    if prompt_ids.numel() < 1:
        raise ValueError("speculative_generate needs a non-empty prompt.")
    logits, aux = target.prefill(prompt_ids)
    tokens: list[int] = []
    _, done = emit_tokens(tokens, [_pick(logits[-1], cfg.temperature, generator)], cfg)
    result = SpecResult(tokens=tokens, verify_count=0)
    if done:
        return result
    began = time.perf_counter()
    root_logits = drafter.start(prompt_ids, tokens[-1], aux)
    while True:
        tree = build_draft(drafter, root_logits, cfg, generator)
        drafter.end_round()
        result.draft_seconds += time.perf_counter() - began
        result.drafted_tokens += len(tree)
        verify_tokens, depths, allowed = tree.verify_inputs(tokens[-1])
        target_logits, target_aux = target.verify(verify_tokens, depths, allowed)
        result.verify_count += 1
        if cfg.temperature == 0:
            path, bonus = accept_greedy(tree, target_logits)
        else:
            path, bonus = accept_sampling(tree, target_logits, cfg.temperature, generator)
        new = [tree.tokens[i] for i in path] + [bonus]
        added, done = emit_tokens(tokens, new, cfg)
        result.accept_lengths.append(added)
        if done:
            return result
        rows = [0] + [i + 1 for i in path]
        target.commit(rows)
        began = time.perf_counter()
        root_logits = drafter.extend(torch.tensor(new), target_aux[rows])


def target_generate(
    target: TargetModel,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_ids: tuple[int, ...] = (),
    seed: int = 0,
) -> list[int]:
    """Plain autoregressive decoding with the target's KV cache (the baseline)."""
    cfg = SpecConfig(max_new_tokens=max_new_tokens, temperature=temperature, eos_token_ids=eos_token_ids)
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    logits, _ = target.prefill(prompt_ids)
    tokens: list[int] = []
    _, done = emit_tokens(tokens, [_pick(logits[-1], temperature, generator)], cfg)
    one = torch.ones(1, 1, dtype=torch.bool)
    while not done:
        logits, _ = target.verify(torch.tensor([tokens[-1]]), torch.zeros(1, dtype=torch.long), one)
        target.commit([0])
        _, done = emit_tokens(tokens, [_pick(logits[0], temperature, generator)], cfg)
    return tokens
