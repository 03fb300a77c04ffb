"""Named model presets for planning before a model is downloaded, and the rule that prefers the real config.

A preset is the architecture part of a model's published config.json (the keys ModelArch reads), copied
from the Hugging Face Hub pages named below; tests/unit/test_target_configs.py holds those published configs
as data and checks every preset against them. Wherever a recipe's paths.target (or paths.source) holds a
config.json, planning reads that file instead: any supported HF config is a target (`--set
paths.target=DIR`), and a preset is only the shape to plan with until it exists.

Sources: Qwen/Qwen3-4B, Qwen/Qwen3-8B, meta-llama/Llama-3.3-70B-Instruct, MiniMaxAI/MiniMax-M2.5 (the M2
family config as published for MiniMax-M2.1, e.g. QuixiAI/MiniMax-M2.1-bf16, with M2.5's vocabulary),
HuggingFaceTB/SmolLM2-135M-Instruct, deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct; the tiny presets are the
toy models megatron_osprey.testing builds.
"""

from __future__ import annotations

import types
from typing import Any

from megatron_osprey.base.arch import ModelArch, hf_config_file

_LLAMA3_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}


def _qwen3(hidden: int, ffn: int, heads: int, layers: int, tied: bool) -> dict[str, Any]:
    return {
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": layers,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "attention_bias": False,
        "tie_word_embeddings": tied,
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
    }


def _deepseek_v3() -> dict[str, Any]:
    return {
        "model_type": "deepseek_v3",
        "first_k_dense_replace": 3,
        "hidden_act": "silu",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "kv_lora_rank": 512,
        "max_position_embeddings": 163840,
        "moe_intermediate_size": 2048,
        "moe_layer_freq": 1,
        "n_group": 8,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 61,
        "num_key_value_heads": 128,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "v_head_dim": 128,
        "vocab_size": 129280,
    }


PRESETS: types.MappingProxyType[str, dict[str, Any]] = types.MappingProxyType(
    {
        "qwen3_4b": _qwen3(2560, 9728, 32, 36, tied=True),
        "qwen3_8b": _qwen3(4096, 12288, 32, 36, tied=False),
        "llama33_70b": {
            "model_type": "llama",
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "num_hidden_layers": 80,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0,
            "rope_scaling": dict(_LLAMA3_ROPE),
            "attention_bias": False,
            "tie_word_embeddings": False,
            "vocab_size": 128256,
            "torch_dtype": "bfloat16",
        },
        "minimax_m25": {
            "model_type": "minimax_m2",
            "hidden_size": 3072,
            "intermediate_size": 1536,
            "num_attention_heads": 48,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "num_hidden_layers": 62,
            "num_local_experts": 256,
            "num_experts_per_tok": 8,
            "rotary_dim": 64,
            "max_position_embeddings": 196608,
            "rms_norm_eps": 1e-06,
            "rope_theta": 5000000,
            "use_qk_norm": True,
            "qk_norm_type": "per_layer",
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
            "shared_intermediate_size": 0,
            "tie_word_embeddings": False,
            "vocab_size": 200064,
            "torch_dtype": "bfloat16",
        },
        # DeepSeek-V3 and Kimi-K2: multi-latent attention, shared + 256 / 384 routed experts (base/deepseek_v3.py).
        # The published checkpoints are block-scaled FP8, dequantized to BF16 as they are read.
        "deepseek_v3": _deepseek_v3(),
        "kimi_k2": {
            **_deepseek_v3(),
            "model_type": "kimi_k2",
            "first_k_dense_replace": 1,
            "max_position_embeddings": 131072,
            "n_group": 1,
            "n_routed_experts": 384,
            "num_attention_heads": 64,
            "num_key_value_heads": 64,
            "num_nextn_predict_layers": 0,
            "rope_scaling": {
                "beta_fast": 1.0,
                "beta_slow": 1.0,
                "factor": 32.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
                "type": "yarn",
            },
            "rope_theta": 50000.0,
            "routed_scaling_factor": 2.827,
            "topk_group": 1,
            "vocab_size": 163840,
        },
        "smollm2_135m_instruct": {
            "model_type": "llama",
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "num_hidden_layers": 30,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-05,
            "rope_theta": 100000,
            "attention_bias": False,
            "tie_word_embeddings": True,
            "vocab_size": 49152,
            "torch_dtype": "bfloat16",
        },
        # Toy models (megatron_osprey.testing) for the CPU recipes.
        "tiny_source": {
            **_qwen3(128, 384, 4, 6, tied=True),
            "num_key_value_heads": 2,
            "head_dim": 64,
            "vocab_size": 512,
            "max_position_embeddings": 4096,
            "torch_dtype": "float32",
        },
        "tiny_target": {
            **_qwen3(192, 512, 4, 4, tied=False),
            "num_key_value_heads": 2,
            "head_dim": 48,
            "vocab_size": 512,
            "max_position_embeddings": 4096,
            "torch_dtype": "float32",
        },
    }
)


def model_arch(preset: str | None, path: str | None, what: str) -> ModelArch:
    """The model's architecture: its config.json at `path` when there is one, else the named preset.

    `what` names the recipe key for errors (paths.target, paths.source). A Hub id is refused: download first.
    """
    if path:
        config = hf_config_file(path, what, missing_ok=True)
        if config is not None:
            return ModelArch.from_hf_config(config)
    if preset is None:
        raise ValueError(f"{what} has no config.json and the recipe names no preset; pass --set {what}=DIR.")
    if preset not in PRESETS:
        raise ValueError(
            f"{what} {path} has no config.json and {preset!r} is not a preset ({', '.join(sorted(PRESETS))}); "
            f"pass --set {what}=DIR with the model's config.json (the directory may hold only that file)."
        )
    return ModelArch.from_hf_config(dict(PRESETS[preset]), source=f"preset {preset!r}")


def preset_config(name: str) -> dict[str, Any]:
    """A copy of a preset's config dict."""
    return dict(PRESETS[name])
