"""The reference speculative decoder with a Megatron-Core target equals the HF target, token for token."""

import pytest
import torch

from megatron_osprey.models.drafter.reference import DrafterConfig, ReferenceDrafter
from megatron_osprey.models.target.megatron_decoding import MegatronTargetModel
from megatron_osprey.speculative import (
    HFTargetModel,
    ReferenceDraftSession,
    SpecConfig,
    speculative_generate,
    target_generate,
)
from megatron_osprey.testing.tiny_models import VOCAB, llama_config, make_hf_model
from tests.unit.test_speculative import transformers_greedy

AUX = [1, 3, 4]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    directory = tmp_path_factory.mktemp("megatron_target")
    return directory, make_hf_model(llama_config(layers=8), directory, seed=4)


def _drafter():
    torch.manual_seed(2)
    cfg = DrafterConfig(
        hidden_size=32,
        target_hidden_size=64,
        num_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=VOCAB,
        aux_layer_ids=AUX,
        variant="osprey",
    )
    drafter = ReferenceDrafter(cfg).eval()
    return drafter


@pytest.mark.parametrize("topk,draft_tokens", [(1, 4), (3, 8)], ids=["chain", "tree"])
def test_megatron_target_matches_hf_target(target, topk, draft_tokens):
    directory, hf = target
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 11, 17)]
    spec = SpecConfig(steps=3, topk=topk, draft_tokens=draft_tokens, max_new_tokens=24)
    hf_runs = [
        speculative_generate(HFTargetModel(hf, AUX), ReferenceDraftSession(_drafter()), p, spec) for p in prompts
    ]
    greedy = [target_generate(HFTargetModel(hf, AUX), p, 24) for p in prompts]
    with MegatronTargetModel.open(directory, AUX) as megatron:
        mg_runs = [speculative_generate(megatron, ReferenceDraftSession(_drafter()), p, spec) for p in prompts]
        mg_greedy = [target_generate(megatron, p, 24) for p in prompts]
        # Tree verify: two siblings at depth 0 see only themselves; logits equal the HF target's.
        tokens, depths, allowed = torch.tensor([7, 9]), torch.tensor([0, 0]), torch.eye(2, dtype=torch.bool)
        megatron.prefill(prompts[1])
        mg_logits, mg_aux = megatron.verify(tokens, depths, allowed)
    reference = HFTargetModel(hf, AUX)
    reference.prefill(prompts[1])
    hf_logits, hf_aux = reference.verify(tokens, depths, allowed)
    torch.testing.assert_close(mg_logits, hf_logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(mg_aux, hf_aux, atol=1e-4, rtol=0)
    for hf_run, mg_run, reference, mg_reference in zip(hf_runs, mg_runs, greedy, mg_greedy):
        assert mg_run.tokens == hf_run.tokens == reference == mg_reference  # lossless, and the same target
        assert mg_run.verify_count == hf_run.verify_count
    # The greedy reference of --verify-lossless against transformers' own decoder.
    assert greedy == [transformers_greedy(hf, p, 24) for p in prompts]


def test_megatron_target_feeds_the_model_on_its_own_device(target):
    # The committed sequence lives on the CPU; a model on a GPU got CPU ids (a device mismatch).
    # "meta" stands in for the GPU: every input must follow the model there.
    directory, _ = target
    with MegatronTargetModel.open(directory, AUX) as megatron:
        megatron.model.to("meta")
        rotary = megatron.model.rotary_pos_emb
        rotary.inv_freq = rotary.inv_freq.to("meta")
        logits, aux = megatron.prefill(torch.arange(5))
    assert logits.device.type == "meta" and aux.device.type == "meta" and logits.shape == (5, VOCAB)


def test_a_causal_only_target_verifies_chains_as_the_masked_one_and_refuses_trees(target):
    """What a Transformer Engine target does (its layers' causal mask type, no explicit mask), on the local spec:
    chain decoding gives the masked target's logits and tokens; a tree verify is refused by name."""
    directory, hf = target
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 11)]
    spec = SpecConfig(steps=3, max_new_tokens=16)
    with MegatronTargetModel.open(directory, AUX) as masked:
        assert masked.causal_only is False  # the local spec: explicit masks
        want = [speculative_generate(masked, ReferenceDraftSession(_drafter()), p, spec) for p in prompts]
        masked.prefill(prompts[1])
        chain = (torch.tensor([3, 4, 5]), torch.arange(3), torch.ones(3, 3, dtype=torch.bool).tril())
        want_logits, want_aux = masked.verify(*chain)
        causal = MegatronTargetModel(masked.model, AUX, VOCAB, causal_only=True)
        got = [speculative_generate(causal, ReferenceDraftSession(_drafter()), p, spec) for p in prompts]
        causal.prefill(prompts[1])
        got_logits, got_aux = causal.verify(*chain)
        causal.commit([0])
        with pytest.raises(ValueError, match="verifies chains only"):
            causal.verify(torch.tensor([7, 9]), torch.tensor([0, 0]), torch.eye(2, dtype=torch.bool))
        causal.capture.remove()
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.accept_lengths for r in got] == [r.accept_lengths for r in want]
    # the layers' default causal mask against the explicit one: the same masked softmax, bit for bit (measured)
    assert torch.equal(got_logits, want_logits) and torch.equal(got_aux, want_aux)
