"""HF -> Megatron-Core logits equality at TP=1, round trip, and clear errors."""

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.convert.hf_to_megatron import load_hf_weights
from megatron_osprey.convert.megatron_to_hf import export_to_hf
from megatron_osprey.models.backbone.gpt import build_gpt_model, rotary_inv_freq
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.testing.tiny_models import VOCAB, causal_logits, llama_config, make_hf_model, qwen3_config

CASES = {
    "qwen3_tied": lambda: qwen3_config(tie=True),
    "qwen3_untied": lambda: qwen3_config(tie=False),
    "llama3_rope_scaling": lambda: llama_config(),
}


@pytest.fixture(scope="module")
def parallel():
    with parallel_context(ParallelConfig()) as state:
        yield state


@pytest.mark.parametrize("case", sorted(CASES))
def test_megatron_logits_equal_hf_and_round_trip_is_bit_identical(case, tmp_path, parallel):
    hf_dir = tmp_path / "hf"
    hf = make_hf_model(CASES[case](), hf_dir)
    arch = ModelArch.from_hf_config(hf_dir)
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits

    model = build_gpt_model(arch, parallel.config, perform_initialization=False).eval()
    load_hf_weights(model, hf_dir, arch, tp_rank=0, tp_size=1)
    with torch.no_grad():
        logits = causal_logits(model, ids)
    assert logits.shape[-1] == arch.padded_vocab_size(1)
    error = (logits[..., :VOCAB] - expected).abs().max().item()
    print(f"{case}: max |megatron - hf| logits = {error:.2e}")
    # Measured 2.1-4.2e-7 (float32 summation order); a norm epsilon 10% too large moves them by 6-7e-5.
    assert error < 4e-6

    out_dir = tmp_path / "roundtrip"
    export_to_hf([model], arch, out_dir)
    original, exported = load_file(hf_dir / "model.safetensors"), load_file(out_dir / "model.safetensors")
    assert set(original) == set(exported)
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name
    config = json.loads((out_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == arch.num_layers
    assert config["architectures"] == [arch.hf_architecture]


def test_llama3_rope_scaling_changes_frequencies():
    arch = ModelArch.from_hf_config(llama_config())
    plain = ModelArch.from_hf_config(
        llama_config().to_dict()
        | {"rope_scaling": None, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}
    )
    scaled, base = rotary_inv_freq(arch), rotary_inv_freq(plain)
    assert torch.equal(scaled[0], base[0])  # high frequencies untouched
    assert torch.allclose(scaled[-1], base[-1] / 8.0)  # low frequencies divided by factor


def test_vocab_is_padded_for_tensor_parallel():
    arch = ModelArch.from_hf_config(qwen3_config(vocab=151936))
    assert arch.padded_vocab_size(1) == 151936
    assert arch.padded_vocab_size(2) == 152064


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"config.json: unsupported architecture model_type='gpt2'"):
        ModelArch.from_hf_config(tmp_path)


def test_missing_config_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelArch.from_hf_config(tmp_path / "nowhere")


@pytest.mark.parametrize("tp,what", [(3, "num_attention_heads"), (4, "num_key_value_heads")])
def test_tensor_parallel_must_divide_heads(tp, what):
    arch = ModelArch.from_hf_config(qwen3_config())  # 4 heads, 2 kv heads
    with pytest.raises(ValueError, match=rf"--tensor-model-parallel-size {tp} does not divide the model's {what}"):
        arch.validate_parallel(tp)


def test_parallel_layout_must_fit_world_size():
    with pytest.raises(ValueError, match="--tensor-model-parallel-size"):
        ParallelConfig(tensor_model_parallel_size=2).validate(world_size=1)


def test_parameter_count_of_qwen3_4b_and_its_two_layer_backbone():
    qwen3_4b = dict(
        model_type="qwen3",
        hidden_size=2560,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=9728,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1000000,
    )
    arch = ModelArch.from_hf_config(qwen3_4b)
    assert arch.num_parameters() == 4_022_468_096  # Qwen3-4B's published 4.0B
    assert arch.with_num_layers(2).num_parameters() == 590_820_352  # Qwen3-4B's first 2 layers, tied embedding: ~591M
