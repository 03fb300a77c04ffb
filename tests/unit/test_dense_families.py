"""Qwen2 (Qwen2.5), Mistral and Gemma 3 as targets from their published config.json: the parse, the field policy,
and `osprey plan` (the Megatron-vs-HF numerics are tests/distributed/test_targets_dense.py).

The dicts below are the config.json files as published on the Hugging Face Hub (Qwen/Qwen2.5-72B-Instruct,
mistralai/Mistral-Small-24B-Instruct-2501, google/gemma-3-27b-it), written here as data so the test needs no network.
"""

from __future__ import annotations

import json

import pytest

from launcher.cli import main as osprey
from megatron_osprey.base.arch import SUPPORTED_FAMILIES, ModelArch, load_target_config
from megatron_osprey.base.config_fields import FIELDS
from megatron_osprey.base.dense_families import GEMMA3_ROPE_THETA, GEMMA3_TEXT_DEFAULTS

QWEN25_72B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 8192,
    "initializer_range": 0.02,
    "intermediate_size": 29568,
    "max_position_embeddings": 32768,
    "max_window_layers": 80,
    "model_type": "qwen2",
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}

MISTRAL_SMALL_24B_INSTRUCT_2501 = {
    "architectures": ["MistralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 32768,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.49.0.dev0",
    "use_cache": True,
    "vocab_size": 131072,
}

GEMMA3_27B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "head_dim": 128,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "model_type": "gemma3_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 62,
        "num_key_value_heads": 16,
        "query_pre_attn_scalar": 168,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}


def _shape(family, layers, hidden, heads, kv, ffn, vocab, theta, *, tie=False, scaling=None, qk=None, **extra):
    return {
        "family": family,
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": 128,
        "ffn_hidden_size": ffn,
        "vocab_size": vocab,
        "tie_word_embeddings": tie,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rotary_dim": 128,
        "qk_norm": qk,
        **extra,
    }


# (published config, its shape, default taps, parameters as the model cards count them, in billions)
CASES = {
    "Qwen2.5-72B-Instruct": (
        QWEN25_72B_INSTRUCT,
        _shape("qwen2", 80, 8192, 64, 8, 29568, 152064, 1e6, max_position_embeddings=32768),
        [1, 39, 76],
        72.7,
    ),
    "Mistral-Small-24B-Instruct-2501": (
        MISTRAL_SMALL_24B_INSTRUCT_2501,
        _shape("mistral", 40, 5120, 32, 8, 32768, 131072, 1e8, max_position_embeddings=32768),
        [1, 19, 36],
        23.6,
    ),
    "gemma-3-27b-it": (
        GEMMA3_27B_IT,
        _shape(
            "gemma3",
            62,
            5376,
            32,
            16,
            21504,
            262208,
            1e6,
            tie=True,
            scaling={"rope_type": "linear", "factor": 8.0},
            qk="head",
            max_position_embeddings=131072,
            sliding_window={"window": 1024, "sliding_layers": 52, "full_layers": 10, "local_rope_theta": 10000.0},
        ),
        [1, 30, 58],
        27.0,  # the language model; the card's 27.4B adds the 0.4B SigLIP vision tower
    ),
}


def _write(tmp_path, config: dict, name: str = "model"):
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("name", list(CASES))
def test_published_config_gives_the_shape_taps_and_size(tmp_path, name):
    config, shape, aux, billions = CASES[name]
    arch = load_target_config(_write(tmp_path, config))
    assert arch.shape() == shape
    assert arch.default_aux_layer_ids == aux
    assert round(arch.num_parameters() / 1e9, 1) == billions


def test_the_families_read_what_their_hf_classes_build():
    qwen2 = ModelArch.from_hf_config(QWEN25_72B_INSTRUCT)
    assert qwen2.qkv_bias and not qwen2.sliding_window  # q/k/v biases; use_sliding_window false
    mistral = ModelArch.from_hf_config(MISTRAL_SMALL_24B_INSTRUCT_2501 | {"sliding_window": 4096})
    assert mistral.sliding_window == 4096 and mistral.sliding_layer_flags == [True] * 40
    gemma = ModelArch.from_hf_config(GEMMA3_27B_IT)
    assert (gemma.hidden_act, gemma.zero_centered_norm, gemma.sandwich_norms) == ("gelu_pytorch_tanh", True, True)
    assert gemma.softmax_scale == 168**-0.5 and gemma.embedding_multiplier == 5376**0.5
    assert gemma.local_rope_theta == 1e4 and gemma.rope_theta == 1e6
    # Five local layers, then a global one: layers 5, 11, ..., 59 are global.
    assert [i for i, s in enumerate(gemma.sliding_layer_flags) if not s] == list(range(5, 62, 6))
    # Truncated (a pruned copy), the pattern goes with the layers; parsing the flat config again gives the same arch.
    assert gemma.with_num_layers(7).sliding_layer_flags == [True] * 5 + [False, True]
    assert ModelArch.from_hf_config(gemma.hf_config) == gemma


def test_gemma3_defaults_and_layer_pattern_are_transformers_own():
    from transformers import Gemma3TextConfig

    reference = Gemma3TextConfig(**GEMMA3_27B_IT["text_config"])
    for key, value in GEMMA3_TEXT_DEFAULTS.items():
        if key not in GEMMA3_27B_IT["text_config"]:
            assert getattr(reference, key) == value, key
    gemma = ModelArch.from_hf_config(GEMMA3_27B_IT)
    assert list(gemma.layer_types) == reference.layer_types
    rope = reference.rope_parameters
    assert (rope["full_attention"]["rope_theta"], rope["sliding_attention"]["rope_theta"]) == (
        GEMMA3_ROPE_THETA["global"],
        GEMMA3_ROPE_THETA["local"],
    )
    assert rope["full_attention"]["factor"] == gemma.rope_scaling["factor"]
    # A config written by transformers 5 (nested rope_parameters, layer_types) parses to the same architecture.
    saved = reference.to_dict() | {"torch_dtype": "bfloat16"}
    assert ModelArch.from_hf_config(saved).shape() == gemma.shape() | {"family": "gemma3_text"}


_GEMMA_TEXT = GEMMA3_27B_IT["text_config"] | {"model_type": "gemma3_text", "torch_dtype": "bfloat16"}
BAD = [
    ("gemma attention softcap", _GEMMA_TEXT, {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0 is not"),
    ("gemma final softcap", _GEMMA_TEXT, {"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0 is not"),
    ("gemma activation", _GEMMA_TEXT, {"hidden_activation": "gelu"}, 'hidden_activation "gelu" is not supported'),
    ("gemma bidirectional", _GEMMA_TEXT, {"use_bidirectional_attention": True}, "use_bidirectional_attention true"),
    ("gemma chunked layers", _GEMMA_TEXT, {"num_hidden_layers": 2, "layer_types": ["chunked_attention"] * 2},
     "layer_types .* each layer is sliding_attention or full_attention"),
    ("gemma local rope scaled", _GEMMA_TEXT,
     {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope_parameters.sliding_attention.rope_type 'linear' is not supported"),
    ("gemma null window", _GEMMA_TEXT, {"sliding_window": None}, "sliding_window is null, yet layer_types has"),
    ("gemma layer count", _GEMMA_TEXT, {"layer_types": ["full_attention"] * 3}, "layer_types has 3 entries for 62"),
    ("qwen2 sliding window", QWEN25_72B_INSTRUCT, {"use_sliding_window": True}, "use_sliding_window true is not"),
    ("mistral window 0", MISTRAL_SMALL_24B_INSTRUCT_2501, {"sliding_window": 0}, "sliding_window 0 must be at least 1"),
    ("linear rope without factor", MISTRAL_SMALL_24B_INSTRUCT_2501, {"rope_scaling": {"rope_type": "linear"}},
     "linear RoPE scaling needs a number `factor`"),
]  # fmt: skip


@pytest.mark.parametrize("case, config, edits, message", BAD, ids=[b[0] for b in BAD])
def test_a_field_these_families_cannot_compute_is_refused_by_name(tmp_path, case, config, edits, message):
    target = _write(tmp_path, config | edits)
    with pytest.raises(ValueError, match=rf"^{target / 'config.json'}: {message}"):
        load_target_config(target)


# Fields of these published configs that the forward pass never reads (the multimodal Gemma 3's image-token ids
# and its vision tower: the drafter reads text; the language model is its text_config).
INERT = {
    "architectures", "model_type", "transformers_version", "bos_token_id", "eos_token_id", "initializer_range",
    "use_cache", "attention_dropout", "boi_token_index", "eoi_token_index", "image_token_index",
    "mm_tokens_per_image", "vision_config", "text_config",
}  # fmt: skip


def test_every_field_of_these_published_configs_is_a_row_or_inert():
    rows = {field.name for field in FIELDS}
    published = {key for config, *_ in CASES.values() for key in config} | set(GEMMA3_27B_IT["text_config"])
    published |= set(GEMMA3_TEXT_DEFAULTS) | {"rope_local_base_freq", "layer_types"}
    assert published - rows - INERT == set()


@pytest.mark.parametrize(
    "name, recipe",
    [
        ("Qwen2.5-72B-Instruct", "llama33_70b_osprey_distill_8gpu_h100_bf16"),
        ("Mistral-Small-24B-Instruct-2501", "llama33_70b_osprey_distill_8gpu_h100_bf16"),
        ("gemma-3-27b-it", "llama33_70b_osprey_distill_8gpu_h100_bf16"),
    ],
)
def test_osprey_plan_json_of_a_published_config(tmp_path, capsys, name, recipe):
    config, shape, aux, _ = CASES[name]
    target = _write(tmp_path, config)
    code = osprey(["plan", recipe, "--stage", "distill", "--set", f"paths.target={target}", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0
    got = plan["target"]
    assert got["model_type"] == shape["family"] and got["source"] == str(target / "config.json")
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert got[key] == shape[key], key
    assert got["aux_layer_ids"] == aux
    assert plan["memory_breakdown_gib"]["target weights"] > 0 and isinstance(plan["fits"], bool)
    assert plan["memory_gib_per_gpu"] == pytest.approx(sum(plan["memory_breakdown_gib"].values()), abs=0.01)


def test_an_unknown_model_type_is_refused_naming_the_supported_list(tmp_path, capsys):
    target = _write(tmp_path, {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]})
    code = osprey(["plan", "llama33_70b_osprey_distill_8gpu_h100_bf16", "--set", f"paths.target={target}", "--json"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "model_type='phi3'" in err[0] and err[0].endswith(f"supported: {', '.join(sorted(SUPPORTED_FAMILIES))}.")
    assert {"qwen2", "mistral", "gemma3_text", "gemma3"} <= set(SUPPORTED_FAMILIES)


def test_the_reference_engine_decodes_a_gemma3_target_as_hf_does(tmp_path):
    """Evaluate's reference engine on the Megatron-Core and on the transformers Gemma 3 target (8-token windows, a
    sequence four windows long): the same tokens and verify counts; chains only on both (a window counts rows)."""
    import torch

    from megatron_osprey.models.target.megatron_decoding import MegatronTargetModel
    from megatron_osprey.speculative import HFTargetModel, ReferenceDraftSession, SpecConfig, speculative_generate
    from megatron_osprey.testing.tiny_models import VOCAB, gemma3_config, make_hf_model
    from tests.unit.test_megatron_target import AUX, _drafter

    hf = make_hf_model(gemma3_config(layers=6), tmp_path, seed=4)
    prompt = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(14))
    spec = SpecConfig(steps=3, max_new_tokens=18)
    tree = (torch.tensor([7, 9]), torch.tensor([0, 0]), torch.eye(2, dtype=torch.bool))
    reference = HFTargetModel(hf, AUX)
    want = speculative_generate(reference, ReferenceDraftSession(_drafter()), prompt, spec)
    with MegatronTargetModel.open(tmp_path, AUX) as megatron:
        got = speculative_generate(megatron, ReferenceDraftSession(_drafter()), prompt, spec)
        for engine in (megatron, reference):
            engine.prefill(prompt)
            with pytest.raises(ValueError, match="verifies chains only"):
                engine.verify(*tree)
    assert got.tokens == want.tokens and got.verify_count == want.verify_count
    assert len(want.tokens) == 18


def test_gemma3_rope_frequencies_are_transformers_own():
    """Both RoPE tables of the Megatron target (global: linear-scaled rope_theta; local: rope_local_base_freq) and
    the EAGLE-3 reference drafter's (which takes the global one) equal Gemma3RotaryEmbedding's, bit for bit."""
    import torch
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from megatron_osprey.models.backbone.gpt import _local_inv_freq, rotary_inv_freq
    from megatron_osprey.models.drafter.arch import DrafterArch, eagle3_body
    from megatron_osprey.models.drafter.reference import rope_inv_freq
    from megatron_osprey.testing.tiny_models import gemma3_config

    config = gemma3_config()
    hf = Gemma3RotaryEmbedding(config)
    arch = ModelArch.from_hf_config(config.to_dict())
    assert torch.equal(rotary_inv_freq(arch), hf.full_attention_inv_freq)
    assert torch.equal(_local_inv_freq(arch), hf.sliding_attention_inv_freq)
    eagle3 = DrafterArch(eagle3_body(arch, 1), arch.hidden_size, arch.vocab_size, 64, (1, 2, 3), variant="eagle3")
    assert torch.equal(rope_inv_freq(eagle3.reference_config()), hf.full_attention_inv_freq)
    assert torch.equal(rotary_inv_freq(eagle3.body), hf.full_attention_inv_freq)  # its Megatron layers
