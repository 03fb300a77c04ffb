"""The config.json facts of the dense families beyond Llama / Qwen3: Qwen2 (Qwen2.5), Mistral and Gemma 3.

- Qwen2: Llama's block with a bias on q_proj / k_proj / v_proj (always; config.json has no field for it).
- Mistral: Llama's block; `sliding_window`, when set, limits every layer's attention to the last W positions.
- Gemma 3 (`gemma3_text`, and the `text_config` of the multimodal `gemma3`): embeddings scaled by sqrt(hidden),
  RMSNorms that multiply by (1 + w), four norms per block (before and after attention and MLP), per-head q/k norms,
  a GELU-tanh gated MLP, attention scaled by query_pre_attn_scalar^-1/2, and local sliding-window layers with their
  own RoPE base (rope_local_base_freq) between global layers (rope_theta, optionally linearly scaled).

Published Gemma 3 configs write only what differs from transformers' Gemma3TextConfig defaults (the 27B
text_config has eleven keys), so the defaults are filled in here, as transformers does when it loads the file.
"""

from __future__ import annotations

from typing import Any

GEMMA3_FAMILIES = ("gemma3_text", "gemma3")
SLIDING, FULL = "sliding_attention", "full_attention"

# transformers' Gemma3TextConfig defaults (tests/unit/test_dense_families.py holds them to the installed release).
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
}
GEMMA3_ROPE_THETA = {"global": 1_000_000.0, "local": 10_000.0}
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # five local layers, then one global


def gemma3_text_config(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The Gemma 3 language model's config as one flat dict: the multimodal config's text_config (its vision tower
    is never run: the drafter reads text), defaults filled, per-layer types written out, RoPE flattened to the
    global layers' `rope_theta` / `rope_scaling` plus `rope_local_base_freq`. Idempotent."""
    flat = dict(config)
    if config.get("model_type") == "gemma3" and isinstance(config.get("text_config"), dict):
        flat = dict(config["text_config"])
        for key in ("torch_dtype", "dtype", "tie_word_embeddings"):  # the multimodal file keeps these outside
            if key not in flat and config.get(key) is not None:
                flat[key] = config[key]
    flat.pop("vision_config", None)
    flat.pop("text_config", None)
    flat["model_type"] = config.get("model_type")
    for key, value in GEMMA3_TEXT_DEFAULTS.items():
        flat.setdefault(key, value)
    rope = flat.pop("rope_parameters", None) or {}
    if FULL in rope or SLIDING in rope:  # transformers 5: one RoPE per layer type
        full, local = dict(rope.get(FULL) or {}), dict(rope.get(SLIDING) or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(
                f"{source}: rope_parameters.{SLIDING}.rope_type {local['rope_type']!r} is not supported: the local "
                f"layers' RoPE is implemented unscaled (default)."
            )
        flat["rope_theta"] = full.pop("rope_theta", GEMMA3_ROPE_THETA["global"])
        flat["rope_local_base_freq"] = local.get("rope_theta", GEMMA3_ROPE_THETA["local"])
        flat["rope_scaling"] = full if full.get("rope_type", "default") != "default" else None
    elif rope:
        flat["rope_scaling"] = rope
    flat.setdefault("rope_theta", GEMMA3_ROPE_THETA["global"])
    flat.setdefault("rope_local_base_freq", GEMMA3_ROPE_THETA["local"])
    if flat.get("layer_types") is None:
        pattern = flat.pop("sliding_window_pattern", flat.pop("_sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN))
        layers = flat["num_hidden_layers"]
        if isinstance(pattern, int) and isinstance(layers, int) and pattern >= 1:
            flat["layer_types"] = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    flat.pop("sliding_window_pattern", None)
    flat.pop("_sliding_window_pattern", None)
    return flat


def family_config(config: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """`config` as the rest of the parse reads it (Gemma 3 flattened; the other families unchanged)."""
    return gemma3_text_config(config, source) if model_type in GEMMA3_FAMILIES else config


def dense_variant_fields(config: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """The ModelArch fields by which Qwen2, Mistral and Gemma 3 differ from the Llama block (empty for others)."""
    fields: dict[str, Any] = {}
    if model_type == "qwen2":
        fields["qkv_bias"] = True  # Qwen2Attention: q/k/v biases always, o_proj none
    if model_type == "mistral" and config.get("sliding_window") is not None:
        layers = int(config["num_hidden_layers"])
        fields.update(sliding_window=int(config["sliding_window"]), layer_types=(SLIDING,) * layers)
    if model_type in GEMMA3_FAMILIES:
        layer_types = tuple(config["layer_types"])
        if len(layer_types) != int(config["num_hidden_layers"]):
            raise ValueError(
                f"{source}: layer_types has {len(layer_types)} entries for {config['num_hidden_layers']} layers."
            )
        if SLIDING in layer_types and config.get("sliding_window") is None:
            raise ValueError(f"{source}: sliding_window is null, yet layer_types has {SLIDING} layers.")
        hidden = int(config["hidden_size"])
        fields.update(
            hidden_act=config["hidden_activation"],
            sliding_window=int(config["sliding_window"]) if SLIDING in layer_types else 0,
            layer_types=layer_types,
            local_rope_theta=float(config["rope_local_base_freq"]),
            zero_centered_norm=True,
            sandwich_norms=True,
            embedding_multiplier=hidden**0.5,
            softmax_scale=float(config["query_pre_attn_scalar"]) ** -0.5,
        )
    return fields
