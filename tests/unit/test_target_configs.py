"""A target is whatever config.json the user has: the published configs of the targets, read from disk, and the
named presets (megatron_osprey/recipes/targets.py) checked against them.

The dicts below are the config.json files as published on the Hugging Face Hub (Qwen/Qwen3-32B,
meta-llama/Llama-3.1-8B-Instruct, Qwen/Qwen3-30B-A3B, MiniMaxAI/MiniMax-M2.5 without its quantization block,
Qwen/Qwen3-8B, Qwen/Qwen3-4B, meta-llama/Llama-3.3-70B-Instruct, HuggingFaceTB/SmolLM2-135M-Instruct without
its transformers.js block), written here as data so the test needs no network.
"""

from __future__ import annotations

import json

import pytest

from megatron_osprey.base.arch import ModelArch, load_target_config
from megatron_osprey.recipes.targets import PRESETS
from tests.unit.test_deepseek_v3 import DEEPSEEK_V3, KIMI_K2_INSTRUCT
from tests.unit.test_glm_gptoss import GPT_OSS_120B

QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 25600,
    "max_position_embeddings": 40960,
    "max_window_layers": 64,
    "model_type": "qwen3",
    "num_attention_heads": 64,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

LLAMA31_8B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3",
    "use_cache": True,
    "vocab_size": 128256,
}

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

MINIMAX_M25 = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "attn_type_list": [1] * 62,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "max_position_embeddings": 196608,
    "model_type": "minimax_m2",
    "mtp_transformer_layers": 1,
    "num_attention_heads": 48,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 62,
    "num_key_value_heads": 8,
    "num_local_experts": 256,
    "num_mtp_modules": 3,
    "output_router_logits": False,
    "qk_norm_type": "per_layer",
    "rms_norm_eps": 1e-06,
    "rope_theta": 5000000,
    "rotary_dim": 64,
    "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0,
    "scoring_func": "sigmoid",
    "shared_intermediate_size": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_mtp": True,
    "use_qk_norm": True,
    "use_routing_bias": True,
    "vocab_size": 200064,
}


QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2560,
    "initializer_range": 0.02,
    "intermediate_size": 9728,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

LLAMA33_70B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 8192,
    "initializer_range": 0.02,
    "intermediate_size": 28672,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.47.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

SMOLLM2_135M_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536,
    "is_llama_config": True,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pad_token_id": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_interleaved": False,
    "rope_scaling": None,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3",
    "use_cache": True,
    "vocab_size": 49152,
}

# meta-llama/Llama-3.2-1B's published config.json: facebook/layerskip-llama3.2-1B is that model trained on with
# LayerSkip's recipe, the same architecture (16 layers, hidden 2048, tied embeddings).
LLAMA32_1B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

# The published config each named preset copies; the tiny_* presets are toy models with no published config.
PUBLISHED_FOR_PRESET = {
    "qwen3_4b": QWEN3_4B,
    "qwen3_8b": QWEN3_8B,
    "llama33_70b": LLAMA33_70B_INSTRUCT,
    "minimax_m25": MINIMAX_M25,
    "smollm2_135m_instruct": SMOLLM2_135M_INSTRUCT,
    "deepseek_v3": DEEPSEEK_V3,
    "kimi_k2": KIMI_K2_INSTRUCT,
    "layerskip_llama32_1b": LLAMA32_1B,
    "gpt_oss_120b": GPT_OSS_120B,
}


def _dense(layers, hidden, heads, kv, ffn, vocab, theta, scaling=None, rotary=128, qk_norm="head"):
    return {
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": 128,
        "ffn_hidden_size": ffn,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rotary_dim": rotary,
        "qk_norm": qk_norm,
    }


LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

CASES = {
    "Qwen3-32B": (
        QWEN3_32B,
        {"family": "qwen3", **_dense(64, 5120, 64, 8, 25600, 151936, 1e6), "max_position_embeddings": 40960},
        [1, 31, 60],
    ),
    "Llama-3.1-8B-Instruct": (
        LLAMA31_8B_INSTRUCT,
        {
            "family": "llama",
            **_dense(32, 4096, 32, 8, 14336, 128256, 5e5, LLAMA3_SCALING, qk_norm=None),
            "max_position_embeddings": 131072,
        },
        [1, 15, 28],
    ),
    "Qwen3-30B-A3B": (
        QWEN3_30B_A3B,
        {
            "family": "qwen3_moe",
            **_dense(48, 2048, 32, 4, 6144, 151936, 1e6),
            "max_position_embeddings": 40960,
            "moe": {
                "num_experts": 128,
                "router_topk": 8,
                "expert_ffn_hidden_size": 768,
                "score_function": "softmax",
                "norm_topk_prob": True,
                "expert_bias": False,
                "moe_layers": "all",
            },
        },
        [1, 23, 44],
    ),
    "MiniMax-M2.5": (
        MINIMAX_M25,
        {
            "family": "minimax_m2",
            **_dense(62, 3072, 48, 8, 1536, 200064, 5e6, rotary=64, qk_norm="projection"),
            "max_position_embeddings": 196608,
            "moe": {
                "num_experts": 256,
                "router_topk": 8,
                "expert_ffn_hidden_size": 1536,
                "score_function": "sigmoid",
                "norm_topk_prob": True,
                "expert_bias": True,
                "moe_layers": "all",
            },
        },
        [1, 30, 58],  # the taps MiniMax-M2.5's Osprey drafter used
    ),
}


def _write(tmp_path, config: dict):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("name", list(CASES))
def test_published_config_gives_the_shape_and_the_default_taps(tmp_path, name):
    config, shape, aux = CASES[name]
    arch = load_target_config(_write(tmp_path, config))
    assert arch.shape() == shape
    assert arch.default_aux_layer_ids == aux
    # The file itself is accepted too, not only its directory.
    assert load_target_config(tmp_path / "model" / "config.json").shape() == shape


@pytest.mark.parametrize("name, layers, aux", [("Qwen3-32B", 40, [1, 19, 36]), ("MiniMax-M2.5", 30, [1, 14, 26])])
def test_the_layer_count_is_read_not_assumed(tmp_path, name, layers, aux):
    config = dict(CASES[name][0], num_hidden_layers=layers)
    if "attn_type_list" in config:
        config["attn_type_list"] = [1] * layers
    arch = load_target_config(_write(tmp_path, config))
    assert arch.num_layers == layers and arch.shape()["num_layers"] == layers
    assert arch.default_aux_layer_ids == aux != CASES[name][2]


def test_an_unsupported_family_is_refused_by_its_model_type(tmp_path):
    config = dict(QWEN3_32B, model_type="phi3", architectures=["Phi3ForCausalLM"])
    with pytest.raises(
        ValueError,
        match=r"model_type='phi3'.*supported: deepseek_v3, gemma3, gemma3_text, glm4_moe, gpt_oss, kimi_k2, llama, "
        r"minimax_m2, mistral, qwen2, qwen3, qwen3_moe\b",
    ):
        load_target_config(_write(tmp_path, config))


def test_a_hub_id_is_refused_with_the_download_step(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"Qwen/Qwen3-32B looks like a Hugging Face Hub id.*download the model first"):
        load_target_config("Qwen/Qwen3-32B")
    # The same string naming a local directory is a path, not a Hub id.
    (tmp_path / "Qwen" / "Qwen3-32B").mkdir(parents=True)
    (tmp_path / "Qwen" / "Qwen3-32B" / "config.json").write_text(json.dumps(QWEN3_32B))
    assert load_target_config("Qwen/Qwen3-32B").num_layers == 64


def test_a_directory_without_config_json_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config\.json there"):
        load_target_config(tmp_path)


def test_every_named_preset_has_a_published_config():
    assert sorted(PUBLISHED_FOR_PRESET) == sorted(p for p in PRESETS if not p.startswith("tiny_"))


@pytest.mark.parametrize("preset", sorted(PUBLISHED_FOR_PRESET))
def test_a_preset_is_what_its_published_config_says(tmp_path, preset):
    published = PUBLISHED_FOR_PRESET[preset]
    # Every key the preset writes has the published value, and the model it describes is the published one.
    assert {k: published.get(k, "<not published>") for k in PRESETS[preset]} == dict(PRESETS[preset])
    assert ModelArch.from_hf_config(dict(PRESETS[preset])) == load_target_config(_write(tmp_path, published))
