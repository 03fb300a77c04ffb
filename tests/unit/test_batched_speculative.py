"""The batched chain engine: the same tokens and acceptance as the batch-1 reference engine, row by row."""

import pytest
import torch

from megatron_osprey.speculative import (
    HFTargetModel,
    ReferenceDraftSession,
    SpecConfig,
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
from megatron_osprey.speculative.batched_draft import BatchedReferenceDraftSession, RowwiseDraftSession
from megatron_osprey.speculative.tree import build_chain
from tests.draft_sessions import ScriptedSession
from tests.unit.test_speculative import AUX, tiny_drafter, tiny_target

STEPS = 4


def random_prompts(vocab: int, count: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (int(torch.randint(1, 14, (1,), generator=gen)),), generator=gen) for _ in range(count)
    ]


def engine(model, prompts, cfg, drafter=None, make_session=None):
    target = BatchedHFTarget(model, AUX, cache_capacity(prompts, cfg, cfg.steps + 1))
    if drafter is not None:
        session = BatchedReferenceDraftSession(drafter, cache_capacity(prompts, cfg, 2 * cfg.steps + 1))
    else:
        session = RowwiseDraftSession(make_session)
    return batched_speculative_generate(target, session, prompts, cfg)


@pytest.mark.parametrize("variant,draft_vocab", [("osprey", 120), ("eagle3", 70)])
def test_batched_drafter_session_equals_the_batch1_session_row_by_row(variant, draft_vocab):
    """Chains and root logits of every row equal ReferenceDraftSession's, through extends of 1..steps+1
    tokens per row (different per row) and a row leaving the batch."""
    vocab, feats = 120, 3 * 32
    drafter = tiny_drafter(vocab, draft_vocab, variant, seed=3)
    gen = torch.Generator().manual_seed(3)
    prompts = random_prompts(vocab, 4, seed=3)
    firsts = [int(t) for t in torch.randint(0, vocab, (4,), generator=gen)]
    aux = [torch.randn(p.numel(), feats, generator=gen, dtype=torch.float64) for p in prompts]
    batched = BatchedReferenceDraftSession(drafter, capacity=200)
    singles = [ReferenceDraftSession(drafter) for _ in prompts]
    root = batched.start(prompts, firsts, aux)
    roots = [s.start(p, f, a) for s, p, f, a in zip(singles, prompts, firsts, aux)]
    cfg = SpecConfig(steps=STEPS, topk=1)
    for round_ in range(5):
        # The drafter's attention softmax runs in float32 (by design), so rows summed over another
        # number of masked slots differ in the last float32 bits; measured max 7e-8.
        torch.testing.assert_close(root, torch.stack(roots), rtol=1e-6, atol=1e-6)
        chains = batched.draft(root, STEPS)
        for row, (session, logits) in enumerate(zip(singles, roots)):
            assert chains[row].tolist() == build_chain(session, logits, cfg, None).tokens, (round_, row)
            session.end_round()
        counts = [int(c) for c in torch.randint(1, STEPS + 2, (len(singles),), generator=gen)]
        tokens = [torch.randint(0, vocab, (c,), generator=gen).tolist() for c in counts]
        new_aux = [torch.randn(c, feats, generator=gen, dtype=torch.float64) for c in counts]
        if round_ == 2:  # row 1 finishes
            keep = [0, 2, 3]
            batched.select(keep)
            singles = [singles[b] for b in keep]
            tokens, new_aux = [tokens[b] for b in keep], [new_aux[b] for b in keep]
        root = batched.extend(tokens, new_aux)
        roots = [s.extend(torch.tensor(t), a) for s, t, a in zip(singles, tokens, new_aux)]


@pytest.mark.parametrize(
    "family,vocab,draft_vocab,variant,seed", [("qwen3", 120, 120, "osprey", 0), ("llama", 200, 150, "eagle3", 1)]
)
def test_batched_engine_equals_the_batch1_engine_and_target_greedy(family, vocab, draft_vocab, variant, seed):
    model = tiny_target(family, vocab, seed)
    drafter = tiny_drafter(vocab, draft_vocab, variant, seed)
    prompts = random_prompts(vocab, 5, seed)
    reference = HFTargetModel(model, AUX)
    expected = [target_generate(reference, p, 18) for p in prompts]
    eos = expected[0][9]  # request 0 stops early at its first occurrence; others may too
    cfg = SpecConfig(max_new_tokens=18, steps=STEPS, topk=1, eos_token_ids=(eos,))
    single = [speculative_generate(reference, ReferenceDraftSession(drafter), p, cfg) for p in prompts]
    got = engine(model, prompts, cfg, drafter=drafter)
    for s, g in zip(single, got):
        assert (g.tokens, g.accept_lengths, g.verify_count) == (s.tokens, s.accept_lengths, s.verify_count)
    target_only = batched_target_generate(
        BatchedHFTarget(model, AUX, cache_capacity(prompts, cfg, 1)), prompts, 18, eos_token_ids=(eos,)
    )
    assert target_only == [target_generate(reference, p, 18, eos_token_ids=(eos,)) for p in prompts]
    assert [g.tokens for g in got] == target_only
    assert len(target_only[0]) == expected[0].index(eos) + 1 < 18  # rows really left the batch early


def test_batched_engine_is_lossless_with_multi_token_acceptance():
    """Scripted drafts (the target's own continuation with periodic misses) accept 1..steps+1 tokens,
    differently per row; the output still equals target-only greedy decoding, and the acceptance
    equals the batch-1 engine's with the same drafts."""
    vocab = 160
    model = tiny_target("qwen3", vocab, 2)
    prompts = random_prompts(vocab, 6, seed=2)
    reference = HFTargetModel(model, AUX)
    expected = [target_generate(reference, p, 30) for p in prompts]
    scripts = [p.tolist() + e for p, e in zip(prompts, expected)]
    cfg = SpecConfig(max_new_tokens=30, steps=STEPS, topk=1)
    single = [
        speculative_generate(reference, ScriptedSession(s, vocab, miss=7), p, cfg) for s, p in zip(scripts, prompts)
    ]
    sessions = iter([ScriptedSession(s, vocab, miss=7) for s in scripts])
    got = engine(model, prompts, cfg, make_session=lambda: next(sessions))
    assert [g.tokens for g in got] == expected
    assert [g.accept_lengths for g in got] == [s.accept_lengths for s in single]
    lengths = [a for g in got for a in g.accept_lengths[:-1]]
    assert max(lengths) == STEPS + 1 and len(set(lengths)) >= 3


def replayed(model, prompts, cfg, session):
    """replay_speculative_generate against target-only greedy outputs and the target's full-sequence features."""
    references = batched_target_generate(
        BatchedHFTarget(model, AUX, cache_capacity(prompts, cfg, 1)), prompts, cfg.max_new_tokens, cfg.eos_token_ids
    )
    sequences = [torch.cat((p, torch.tensor(r[:-1], dtype=torch.long))) for p, r in zip(prompts, references)]
    features = target_features(BatchedHFTarget(model, AUX, max(s.numel() for s in sequences)), sequences)
    return replay_speculative_generate(session, prompts, references, features, cfg)


@pytest.mark.parametrize(
    "family,vocab,draft_vocab,variant,seed", [("qwen3", 120, 120, "osprey", 0), ("llama", 200, 150, "eagle3", 1)]
)
def test_replayed_acceptance_equals_live_decoding(family, vocab, draft_vocab, variant, seed):
    """Replaying the target's greedy output gives every request the live engine's tokens, accept lengths and
    verify count, with a real drafter (EOS cutting some rows short) and with scripted multi-token acceptance."""
    model = tiny_target(family, vocab, seed)
    drafter = tiny_drafter(vocab, draft_vocab, variant, seed)
    prompts = random_prompts(vocab, 5, seed)
    reference = HFTargetModel(model, AUX)
    eos = target_generate(reference, prompts[0], 18)[9]
    cfg = SpecConfig(max_new_tokens=18, steps=STEPS, topk=1, eos_token_ids=(eos,))
    live = engine(model, prompts, cfg, drafter=drafter)
    session = BatchedReferenceDraftSession(drafter, cache_capacity(prompts, cfg, 2 * cfg.steps + 1))
    got = replayed(model, prompts, cfg, session)
    assert [(g.tokens, g.accept_lengths, g.verify_count) for g in got] == [
        (x.tokens, x.accept_lengths, x.verify_count) for x in live
    ]
    cfg = SpecConfig(max_new_tokens=30, steps=STEPS, topk=1)
    scripts = [p.tolist() + target_generate(reference, p, 30) for p in prompts]
    live_sessions, replay_sessions = (iter([ScriptedSession(s, vocab) for s in scripts]) for _ in range(2))
    live = engine(model, prompts, cfg, make_session=lambda: next(live_sessions))
    got = replayed(model, prompts, cfg, RowwiseDraftSession(lambda: next(replay_sessions)))
    assert [(g.tokens, g.accept_lengths) for g in got] == [(x.tokens, x.accept_lengths) for x in live]
    assert max(a for g in got for a in g.accept_lengths) == STEPS + 1


def test_replay_refuses_features_that_do_not_cover_the_reference():
    prompts = random_prompts(50, 2, 0)
    cfg = SpecConfig(max_new_tokens=4, steps=2, topk=1)
    features = [torch.zeros(p.numel(), 96, dtype=torch.float64) for p in prompts]
    with pytest.raises(ValueError, match="prompt \\+ reference"):
        replay_speculative_generate(RowwiseDraftSession(lambda: None), prompts, [[1, 2, 3, 4]] * 2, features, cfg)


def test_batched_engine_refuses_trees_and_sampling():
    model = tiny_target("qwen3", 50, 0)
    prompts = random_prompts(50, 2, 0)
    for shape in (dict(steps=3, topk=2, draft_tokens=5), dict(steps=3, topk=1, temperature=0.7)):
        cfg = SpecConfig(max_new_tokens=4, **shape)
        with pytest.raises(ValueError, match="greedy chains only"):
            engine(model, prompts, cfg, make_session=lambda: None)
