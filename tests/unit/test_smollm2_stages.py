"""Every stage on the real target, SmolLM2-135M-Instruct (30 layers, hidden 576, 9/3 heads, vocab 49,152,
tied), in float32 on one CPU rank: HF -> Megatron -> HF, Stage 1 prune, hidden-state extraction, and
lossless greedy speculative decoding with a drafter adapted from SmolLM2's own first 2 layers.

TP=2 and PP=2 are in tests/distributed/test_smollm2_parallel.py. Tolerances are about 10x the error
measured on this CPU (torch 2.13 CPU wheel); the measured figure is next to each.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.convert.hf_to_megatron import load_hf_weights
from megatron_osprey.convert.megatron_to_hf import export_to_hf
from megatron_osprey.models.backbone.gpt import build_gpt_model
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.testing.tiny_models import causal_logits, truncated_logits
from tests.draft_sessions import ScriptedSession
from tests.real_model import PROMPTS, SMOLLM2_AUX, chat_ids

VOCAB = 49152
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer):
    return [chat_ids(smollm2_tokenizer, text) for text in PROMPTS]


@pytest.fixture(scope="module")
def long_ids(prompt_ids):
    """The three chat prompts back to back (~110 tokens): positions well past the first few."""
    return torch.cat(prompt_ids)[None]


def test_megatron_logits_equal_hf_and_round_trip_is_bit_identical(smollm2_dir, smollm2, long_ids, tmp_path):
    arch = ModelArch.from_hf_config(smollm2_dir)
    assert (arch.num_layers, arch.hidden_size, arch.padded_vocab_size(1)) == (30, 576, VOCAB)
    with torch.no_grad():
        expected = smollm2(long_ids).logits
    with parallel_context(ParallelConfig()) as state:
        model = build_gpt_model(arch, state.config, perform_initialization=False).eval()
        load_hf_weights(model, smollm2_dir, arch, tp_rank=0, tp_size=1)
        with torch.no_grad():
            logits = causal_logits(model, long_ids)
        export_to_hf([model], arch, tmp_path / "roundtrip")
    # Measured: 7.9e-5 max abs over logits of magnitude ~35 (float32 summation order over 30 layers).
    assert (logits - expected).abs().max().item() < 8e-4
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))

    original, exported = (
        load_file(smollm2_dir / "model.safetensors"),
        load_file(tmp_path / "roundtrip" / "model.safetensors"),
    )
    assert set(exported) == set(original) and "lm_head.weight" not in exported  # tied, as the source
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    config = json.loads((tmp_path / "roundtrip" / "config.json").read_text())
    source = json.loads((smollm2_dir / "config.json").read_text())
    for key in (
        "num_hidden_layers",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
        "tie_word_embeddings",
        "rms_norm_eps",
        "architectures",
    ):
        assert config[key] == source[key], key


@pytest.fixture(scope="module")
def pruned(smollm2_dir, tmp_path_factory):
    """Stage 1: SmolLM2 pruned to its first 2 layers (the Osprey arm's same-family backbone)."""
    from megatron_osprey.stages import prune
    from megatron_osprey.stages.prune import PruneConfig

    out = tmp_path_factory.mktemp("smollm2_pruned") / "out"
    result = prune.run(PruneConfig(source=str(smollm2_dir), output=str(out), num_layers=2))  # its own groups
    return out, result


def test_pruned_logits_equal_truncated_hf(pruned, smollm2, long_ids):
    from transformers import AutoModelForCausalLM

    from megatron_osprey.training.checkpointing import load_checkpoint

    out, result = pruned
    assert result.kept_layers == [0, 1]
    # Embedding (tied) + 2 blocks + final norm.
    assert result.arch.num_layers == 2
    assert result.arch.num_parameters() == VOCAB * 576 + 2 * 3_540_096 + 576
    expected = truncated_logits(smollm2, long_ids, num_layers=2)

    pruned_hf = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).eval()
    assert pruned_hf.config.num_hidden_layers == 2
    with torch.no_grad():
        hf_logits = pruned_hf(long_ids).logits
    # Measured: 0.0 (the same HF code on the same weights).
    assert (hf_logits - expected).abs().max().item() < 1e-5

    arch = ModelArch.from_hf_config(out / "hf")
    with parallel_context(ParallelConfig()) as state:
        model = build_gpt_model(arch, state.config).eval()
        loaded, _ = load_checkpoint(out / "megatron", model.sharded_state_dict())
        model.load_state_dict(loaded)
        with torch.no_grad():
            megatron_logits = causal_logits(model, long_ids)
    # Measured: 3.8e-5.
    assert (megatron_logits - expected).abs().max().item() < 4e-4
    # The truncated model is a different function from the full one: this is not the identity.
    assert (expected - smollm2(long_ids).logits.detach()).abs().max().item() > 1.0
    assert (out / "hf" / "chat_template.jinja").is_file() and (out / "hf" / "tokenizer.json").is_file()


def test_extracted_hidden_states_equal_hf_at_the_aux_and_final_layers(
    smollm2_dir, smollm2, smollm2_tokenizer, tmp_path
):
    from megatron_osprey.data.extract import extract_hidden_states
    from megatron_osprey.data.hidden_state_store import HiddenStateStore, HiddenStateStoreConfig
    from megatron_osprey.models.target.config import TargetConfig
    from megatron_osprey.stages.extract import ExtractConfig

    data = tmp_path / "conversations.jsonl"
    rows = [
        [{"role": "user", "content": PROMPTS[1]}, {"role": "assistant", "content": "The capital of France is Paris."}],
        [
            {"role": "user", "content": PROMPTS[0]},
            {"role": "assistant", "content": "```python\ndef reverse(s):\n    return s[::-1]\n```"},
        ],
    ]
    data.write_text("".join(json.dumps({"id": f"c{i}", "conversations": c}) + "\n" for i, c in enumerate(rows)))
    config = ExtractConfig(
        target=TargetConfig(path=str(smollm2_dir)),
        data_path=str(data),
        micro_batch_size=2,
        store=HiddenStateStoreConfig(store_dir=str(tmp_path / "store")),
    )
    arch = ModelArch.from_hf_config(smollm2_dir)
    with parallel_context(ParallelConfig()) as state:
        extract_hidden_states(config, state, arch, log=lambda _: None)
    store = HiddenStateStore(tmp_path / "store", dtype=torch.float32)
    assert len(store) == 2 and tuple(store.header.aux_layer_ids) == SMOLLM2_AUX  # the default taps for 30 layers

    worst = 0.0
    for sample in store:
        ids = sample["input_ids"]
        assert ids.tolist()[:3] == [1, 9690, 198]  # "<|im_start|>system\n": the SmolLM2 chat template
        captured = []
        hook = smollm2.model.layers[-1].register_forward_hook(
            lambda m, i, o: captured.append(o[0] if isinstance(o, tuple) else o)
        )
        try:
            with torch.no_grad():
                hidden = smollm2(ids[None], output_hidden_states=True).hidden_states
        finally:
            hook.remove()
        # hidden_states[i + 1] is layer i's output; HF's last entry is after the final norm, the store
        # keeps the pre-norm output of the last layer (the drafter's TTT input and the LM head's input).
        expected = {
            "aux_hidden": torch.cat([hidden[i + 1][0] for i in SMOLLM2_AUX], dim=-1),
            "final_hidden": captured[0][0],
        }
        for key, reference in expected.items():
            stored = sample[key]
            assert stored.shape == reference.shape, key
            # The store is bf16: the Megatron target's float32 values, rounded once (|values| reach 2.5e4,
            # SmolLM2's massive activations). Measured: every element within one bf16 ulp (2^-8 relative)
            # of HF's float32 value plus at most 6.3e-5 (the float32 difference of the two targets), and
            # 99.8% equal to HF's value rounded to bf16.
            diff = (stored - reference).abs()
            excess = (diff - 2.0**-8 * reference.abs()).max().item()
            worst = max(worst, diff.max().item())
            assert excess < 5e-4, key
            assert (stored == reference.bfloat16().float()).float().mean().item() > 0.99, key
    assert worst > 1.0  # bf16 rounding of large values is visible: HF's values are not the stored ones


@pytest.fixture(scope="module")
def adapted(pruned, smollm2_dir, tmp_path_factory):
    """Stage 3 on the pruned SmolLM2 backbone for the SmolLM2 target: the drafter at initialization."""
    from megatron_osprey.eval.loading import load_drafter
    from megatron_osprey.stages import adapt
    from megatron_osprey.stages.adapt import AdaptConfig

    out = tmp_path_factory.mktemp("smollm2_adapted") / "out"
    report = adapt.run(AdaptConfig(backbone=str(pruned[0]), target=str(smollm2_dir), output=str(out)))  # own groups
    return load_drafter(out).drafter, report


@pytest.fixture(scope="module")
def greedy_reference(smollm2, prompt_ids):
    """transformers' own greedy decoding, the independent reference (stops at <|im_end|>)."""
    outputs = []
    for ids in prompt_ids:
        with torch.no_grad():
            out = smollm2.generate(
                ids[None], max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=EOS, pad_token_id=EOS
            )
        outputs.append(out[0, ids.numel() :].tolist())
    return outputs


MAX_NEW = 24


@pytest.mark.parametrize("shape", [dict(steps=4, topk=1), dict(steps=3, topk=3, draft_tokens=8)], ids=["chain", "tree"])
def test_speculative_decoding_with_the_real_target_is_lossless(
    shape, adapted, smollm2, smollm2_tokenizer, prompt_ids, greedy_reference
):
    from megatron_osprey.speculative import HFTargetModel, ReferenceDraftSession, SpecConfig, speculative_generate

    drafter, report = adapted
    # Same tokenizer on both sides: every ordinary row is copied, none averaged.
    assert report["counts"]["copied"] > 49_000 and report["counts"].get("averaged", 0) == 0
    assert list(drafter.config.aux_layer_ids) == list(SMOLLM2_AUX)
    assert smollm2_tokenizer.decode(greedy_reference[0]).startswith("```python\ndef ")  # real text, not noise
    target = HFTargetModel(smollm2, list(SMOLLM2_AUX))
    cfg = SpecConfig(max_new_tokens=MAX_NEW, eos_token_ids=(EOS,), **shape)
    scripted = []
    for ids, expected in zip(prompt_ids, greedy_reference):
        result = speculative_generate(target, ReferenceDraftSession(drafter), ids, cfg)
        assert result.tokens == expected, smollm2_tokenizer.decode(result.tokens)
        result = speculative_generate(target, ScriptedSession(ids.tolist() + expected, VOCAB), ids, cfg)
        assert result.tokens == expected, smollm2_tokenizer.decode(result.tokens)
        scripted += result.accept_lengths[:-1]  # the last round may be cut by max_new_tokens or EOS
    # Full rounds and rounds cut by a rejection: multi-token commits after partial acceptance were checked.
    assert max(scripted) == shape["steps"] + 1 and min(scripted) < shape["steps"] + 1


def test_batched_speculative_decoding_with_the_real_target_is_lossless(adapted, smollm2, prompt_ids, greedy_reference):
    """The batched engine (the three prompts in one batch, float32) with the adapted drafter, and with
    scripted drafts that make rows accept different numbers of tokens, equals transformers' greedy output."""
    from megatron_osprey.speculative import SpecConfig
    from megatron_osprey.speculative.batched import (
        BatchedHFTarget,
        batched_speculative_generate,
        batched_target_generate,
        cache_capacity,
    )
    from megatron_osprey.speculative.batched_draft import BatchedReferenceDraftSession, RowwiseDraftSession

    drafter, _ = adapted
    cfg = SpecConfig(max_new_tokens=MAX_NEW, eos_token_ids=(EOS,), steps=4, topk=1)
    aux = list(SMOLLM2_AUX)
    target = BatchedHFTarget(smollm2, aux, cache_capacity(prompt_ids, cfg, 1))
    assert batched_target_generate(target, prompt_ids, MAX_NEW, (EOS,)) == greedy_reference
    target = BatchedHFTarget(smollm2, aux, cache_capacity(prompt_ids, cfg, cfg.steps + 1))
    session = BatchedReferenceDraftSession(drafter, cache_capacity(prompt_ids, cfg, 2 * cfg.steps + 1))
    assert [r.tokens for r in batched_speculative_generate(target, session, prompt_ids, cfg)] == greedy_reference
    scripts = iter(
        [ScriptedSession(ids.tolist() + expected, VOCAB) for ids, expected in zip(prompt_ids, greedy_reference)]
    )
    target = BatchedHFTarget(smollm2, aux, cache_capacity(prompt_ids, cfg, cfg.steps + 1))
    results = batched_speculative_generate(target, RowwiseDraftSession(lambda: next(scripts)), prompt_ids, cfg)
    assert [r.tokens for r in results] == greedy_reference
    per_row = [tuple(r.accept_lengths) for r in results]
    assert len(set(per_row)) == len(per_row) and max(max(a) for a in per_row) == cfg.steps + 1
