"""Reference speculative decoding: greedy identity, acceptance extremes, lossless sampling."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from megatron_osprey.models.drafter.reference import DrafterConfig, ReferenceDrafter
from megatron_osprey.speculative import (
    DraftSession,
    HFTargetModel,
    ReferenceDraftSession,
    SpecConfig,
    TargetModel,
    acceptance_summary,
    speculative_generate,
    target_generate,
)
from tests.draft_sessions import RecomputeSession

AUX = [0, 1, 2]
CHAIN = dict(steps=4, topk=1)
TREE = dict(steps=3, topk=3, draft_tokens=8)


def tiny_target(family: str, vocab: int, seed: int):
    """Random 4-layer HF target in float64 (so argmax ties cannot differ between code paths)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    cls, cfg = (Qwen3ForCausalLM, Qwen3Config) if family == "qwen3" else (LlamaForCausalLM, LlamaConfig)
    model = cls(cfg(**common))
    with torch.no_grad():  # sharpen the output so greedy text is not a single repeated token
        model.lm_head.weight.mul_(8.0)
    return model.double().eval()


def tiny_drafter(vocab: int, draft_vocab: int, variant: str, seed: int) -> ReferenceDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        hidden_size=32,
        target_hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        qk_layernorm=True,
        aux_layer_ids=AUX,
        variant=variant,
    )
    drafter = ReferenceDrafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.2)
    drafter.set_draft_vocab(torch.randperm(vocab)[:draft_vocab])
    return drafter.double().eval()


class OracleSession(RecomputeSession):
    """Proposals from the target itself (full recompute); `mode` bends them.

    mode "exact": the target's own logits; "wrong": the target's argmax gets -inf;
    "noisy": logits plus Gaussian noise, so acceptance is partial.
    """

    def __init__(self, model, mode: str = "exact", seed: int = 0):
        super().__init__()
        self.model, self.mode = model, mode
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def _logits(self, seq):
        logits = self.model(torch.tensor([seq])).logits[0, -1].clone()
        if self.mode == "wrong":
            logits[logits.argmax()] = float("-inf")
        elif self.mode == "noisy":
            noise = torch.randn(logits.shape, generator=self.generator, dtype=logits.dtype)
            logits += 0.7 * logits.std() * noise
        return logits


def transformers_greedy(model, prompt: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """model.generate(do_sample=False): an independent greedy decoder (its own cache and stopping)."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), generation_config=config)
    return out[0, prompt.numel() :].tolist()


CASES = [("qwen3", 120, 120, "osprey", 0), ("llama", 200, 150, "eagle3", 1), ("qwen3", 160, 90, "osprey", 2)]


@pytest.mark.parametrize("family,vocab,draft_vocab,variant,seed", CASES)
def test_greedy_speculative_output_is_identical_to_target_greedy(family, vocab, draft_vocab, variant, seed):
    model = tiny_target(family, vocab, seed)
    target = HFTargetModel(model, AUX)
    drafter = tiny_drafter(vocab, draft_vocab, variant, seed)
    gen = torch.Generator().manual_seed(seed)
    accept_lengths = []
    for i in range(3):
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen)
        expected = target_generate(target, prompt, max_new_tokens=15)
        # --verify-lossless's reference is this KV-cache adapter: hold it to transformers' own decoder.
        assert expected == transformers_greedy(model, prompt, 15)
        eos = expected[8]  # stop early at its first occurrence
        expected_eos = expected[: expected.index(eos) + 1]
        assert target_generate(target, prompt, 15, eos_token_ids=(eos,)) == expected_eos
        assert expected_eos == transformers_greedy(model, prompt, 15, eos_token_id=eos)
        for shape in (CHAIN, TREE):
            for session in (ReferenceDraftSession(drafter), OracleSession(model, "noisy", seed=i)):
                got = speculative_generate(target, session, prompt, SpecConfig(max_new_tokens=15, **shape))
                assert got.tokens == expected, (shape, type(session).__name__)
                assert 1 + sum(got.accept_lengths) == len(got.tokens) == 15
                accept_lengths += got.accept_lengths
            cfg = SpecConfig(max_new_tokens=15, eos_token_ids=(eos, vocab + 5), **shape)
            assert speculative_generate(target, session, prompt, cfg).tokens == expected_eos
    # The noisy oracle exercised both full rejection and multi-token acceptance.
    assert accept_lengths.count(1) > 10 and sum(a > 2 for a in accept_lengths) > 3


@pytest.mark.parametrize("shape", [CHAIN, dict(steps=2, topk=1), TREE])
def test_oracle_drafter_accepts_everything_and_wrong_drafter_nothing(shape):
    model = tiny_target("qwen3", 100, 7)
    target = HFTargetModel(model, AUX)
    prompt = torch.tensor([5, 17, 3])
    cfg = SpecConfig(max_new_tokens=1 + 4 * (shape["steps"] + 1) + 2, **shape)
    expected = target_generate(target, prompt, cfg.max_new_tokens)
    oracle = speculative_generate(target, OracleSession(model, "exact"), prompt, cfg)
    assert oracle.tokens == expected
    if shape["topk"] == 1:
        assert oracle.accept_lengths == [cfg.draft_tokens] * 4 + [2]
        assert oracle.verify_count == 5
    else:  # the argmax path can lose the cumulative-score ranking, but a good share gets through
        assert sum(oracle.accept_lengths) / oracle.verify_count > 2
    wrong = speculative_generate(target, OracleSession(model, "wrong"), prompt, cfg)
    assert wrong.tokens == expected
    assert wrong.accept_lengths == [1] * (cfg.max_new_tokens - 1)
    assert wrong.acceptance_length == cfg.max_new_tokens / (cfg.max_new_tokens - 1)
    summary = acceptance_summary([oracle, wrong])
    assert summary["pooled_acceptance_length"] == 2 * cfg.max_new_tokens / (oracle.verify_count + wrong.verify_count)


def test_first_token_eos_and_max_new_tokens_one_need_no_verify():
    model = tiny_target("llama", 64, 3)
    target = HFTargetModel(model, AUX)
    prompt = torch.tensor([1, 2, 3])
    first = target_generate(target, prompt, 1)
    session = OracleSession(model)
    for cfg in (SpecConfig(max_new_tokens=1), SpecConfig(max_new_tokens=9, eos_token_ids=(first[0],))):
        result = speculative_generate(target, session, prompt, cfg)
        assert result.tokens == first and result.verify_count == 0 and result.acceptance_length == 1.0


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor(float(len(counts) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


class PositionalBigramTarget(TargetModel):
    """Fast exact target for sampling tests: logits of the token at position t are A[token] + B[t]."""

    def __init__(self, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab
        self.A = torch.randn(vocab, vocab, generator=g, dtype=torch.float64)
        self.B = 0.5 * torch.randn(64, vocab, generator=g, dtype=torch.float64)
        self.features = torch.randn(vocab, 96, generator=g, dtype=torch.float64)
        self.length, self.pending = 0, 0

    @property
    def cache_length(self):
        return self.length

    def prefill(self, input_ids):
        self.length = input_ids.numel()
        return self.A[input_ids] + self.B[: self.length], self.features[input_ids]

    def verify(self, tokens, depths, allowed):
        self.pending = tokens.numel()
        return self.A[tokens] + self.B[self.length + depths], self.features[tokens]

    def commit(self, keep):
        assert keep == sorted(keep) and keep[0] == 0 and max(keep) < self.pending
        self.length += len(keep)

    def next_token_probs(self, position: int) -> torch.Tensor:
        """[V, V]: row = token at `position`, column = next token."""
        return torch.softmax(self.A + self.B[position], -1)


class BigramDraftSession(DraftSession):
    """Drafter whose logits depend on the last token only (table D), so q is known exactly."""

    def __init__(self, target: PositionalBigramTarget, seed: int):
        g = torch.Generator().manual_seed(seed)
        # Close to the target's kernel (so drafts are often accepted) but not equal to it.
        self.D = target.A + 0.8 * torch.randn(target.A.shape, generator=g, dtype=torch.float64)
        self.tokens = []

    def start(self, prompt_ids, first_token, aux):
        return self.extend(torch.tensor([first_token]), aux)

    def extend(self, tokens, aux):
        self.tokens = []
        return self.D[tokens[-1]]

    def expand(self, parents, tokens):
        self.tokens += tokens.tolist()
        return self.D[tokens]

    def end_round(self):
        self.tokens = []


@pytest.mark.parametrize(
    "shape", [dict(steps=3, topk=1), dict(steps=3, topk=1, sample_drafts=False), dict(steps=3, topk=2, draft_tokens=5)]
)
def test_sampling_is_lossless_by_chi_square(shape):
    vocab, samples, prompt = 8, 2000, torch.tensor([3, 1, 4, 1, 5])
    target = PositionalBigramTarget(vocab, seed=11)
    session = BigramDraftSession(target, seed=12)
    cfg = SpecConfig(max_new_tokens=4, temperature=1.0, **shape)
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(4, vocab, dtype=torch.float64)
    drafts_accepted = 0
    for _ in range(samples):
        result = speculative_generate(target, session, prompt, cfg, generator=generator)
        for position, token in enumerate(result.tokens):
            counts[position, token] += 1
        drafts_accepted += sum(a - 1 for a in result.accept_lengths)
    # Exact marginals of the target's own sampling: a Markov chain with position-dependent kernels.
    n = prompt.numel()
    marginal = torch.softmax(target.A[prompt[-1]] + target.B[n - 1], -1)
    for position in range(4):
        assert chi_square_pvalue(counts[position], marginal) > 1e-3, position
        marginal = marginal @ target.next_token_probs(n + position)
    assert drafts_accepted > samples // 2  # later tokens really went through acceptance
    # Power check: had every draft been accepted, token 2 would follow the drafter's kernel.
    x1 = torch.softmax(target.A[prompt[-1]] + target.B[n - 1], -1)
    assert chi_square_pvalue(counts[1], x1 @ torch.softmax(session.D, -1)) < 1e-6


def test_bad_spec_config_raises_naming_the_field():
    with pytest.raises(ValueError, match="draft_tokens must equal steps"):
        SpecConfig(steps=5, topk=1, draft_tokens=4)
    with pytest.raises(ValueError, match="draft_tokens must be in"):
        SpecConfig(steps=2, topk=2, draft_tokens=9)
    assert SpecConfig().draft_tokens == 6


def test_reference_session_tree_rows_match_plain_chain_decoding():
    """Each tree node sees only its own ancestors: equal to decoding that branch alone."""
    from megatron_osprey.models.drafter.reference import DrafterKVCache

    drafter = tiny_drafter(50, 40, "osprey", 5)
    session = ReferenceDraftSession(drafter)
    prompt, aux = torch.tensor([4, 9, 2, 7]), torch.randn(4, 96, dtype=torch.float64)
    session.start(prompt, 11, aux)
    # Two branches of depth 2 under the root: ids 0,1 at depth 1; 2 (child of 1), 3 (child of 0) at depth 2.
    session.expand([-1, -1], torch.tensor([3, 8]))
    tree_logits = session.expand([1, 0], torch.tensor([5, 6]))
    with torch.no_grad():
        for branch, row in (([8, 5], 0), ([3, 6], 1)):
            cache = DrafterKVCache()
            _, g = drafter(torch.tensor([[9, 2, 7, 11]]), aux_hidden=aux[None], kv_cache=cache)
            g = g[:, -1:]
            for token in branch:
                logits, g = drafter(torch.tensor([[token]]), g=g, kv_cache=cache)
            torch.testing.assert_close(tree_logits[row], drafter.target_logits(logits[0, 0]))
    session.end_round()
    assert session.cache.length == 4
