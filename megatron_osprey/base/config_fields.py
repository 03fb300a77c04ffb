"""The fields of a target's config.json that change what the model computes, each with the type and the values
this project implements; any other value is refused by name before a weight is read.

A field missing here is one the forward pass never reads (token ids, initializer range, use_cache, router
training losses, multi-token-prediction heads the drafter never runs). A new field that does change the
computation is a row in FIELDS, as a new weight is a row of convert/weight_map.py.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

INT, NUMBER, BOOL, STR, LIST, DICT = "an integer", "a number", "true or false", "a string", "a list", "an object"
CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ConfigField:
    """One config.json field: its JSON type, whether every config needs it, and which values are implemented."""

    name: str
    kind: str
    required: bool = False
    minimum: float | None = None  # the least value that means anything (1 for counts, >0 for eps and theta)
    supported: Callable[[Any], bool] | None = None  # None: every value of the type is implemented
    why: str = ""  # what another value would need that the Megatron model does not build
    families: tuple[str, ...] = ()  # () every family
    skip_families: tuple[str, ...] = ()  # families with a row of their own for this field


def _false(value) -> bool:
    return value is False


def _full_attention(layer_types) -> bool:
    return all(t == "full_attention" for t in layer_types)


def _window_layer_types(layer_types) -> bool:
    return all(t in ("sliding_attention", "full_attention") for t in layer_types)


_NO_SLIDING = "sliding-window attention is not implemented: every layer attends to the whole sequence"
_QWEN3 = ("qwen3", "qwen3_moe", "qwen2")  # Qwen2's window fields too (use_sliding_window false in Qwen2.5)
_GLM_GPTOSS = ("glm4_moe", "gpt_oss")
_GLM, _GPTOSS = ("glm4_moe",), ("gpt_oss",)
_GEMMA3 = ("gemma3_text", "gemma3")  # the multimodal config's text_config, flattened by base/dense_families.py
# Sliding windows implemented: Mistral and Gemma 3 (models/backbone/dense_variants.py), gpt-oss (glm_gptoss.py).
_WINDOWED = ("mistral", *_GEMMA3, "gpt_oss")


def _mxfp4(quantization) -> bool:
    return quantization.get("quant_method") == "mxfp4"


def _fp8_blocks(quant) -> bool:
    block = quant.get("weight_block_size")
    return (
        quant.get("quant_method") == "fp8"
        and quant.get("fmt", "e4m3") == "e4m3"
        and isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    )


_DEEPSEEK = ("deepseek_v3", "kimi_k2")
# DeepSeek-V3 / Kimi-K2 (base/deepseek_v3.py reads them; it refuses the value combinations a row cannot see).
DEEPSEEK_V3_FIELDS: tuple[ConfigField, ...] = (
    ConfigField("q_lora_rank", INT, minimum=1, families=_DEEPSEEK),  # null: one q_proj
    ConfigField("kv_lora_rank", INT, required=True, minimum=1, families=_DEEPSEEK),
    ConfigField("qk_nope_head_dim", INT, required=True, minimum=1, families=_DEEPSEEK),
    ConfigField(
        "qk_rope_head_dim",
        INT,
        required=True,
        minimum=2,
        supported=lambda v: v % 2 == 0,
        why="RoPE rotates channel pairs, so the rope part must be even",
        families=_DEEPSEEK,
    ),
    ConfigField("v_head_dim", INT, required=True, minimum=1, families=_DEEPSEEK),
    ConfigField("qk_head_dim", INT, minimum=1, families=_DEEPSEEK),  # written by transformers: nope + rope
    ConfigField("rope_interleave", BOOL, families=_DEEPSEEK),
    ConfigField("n_routed_experts", INT, required=True, minimum=1, families=_DEEPSEEK),
    ConfigField("n_shared_experts", INT, minimum=0, families=_DEEPSEEK),
    ConfigField("num_experts_per_tok", INT, required=True, minimum=1, families=_DEEPSEEK),
    ConfigField("moe_intermediate_size", INT, required=True, minimum=1, families=_DEEPSEEK),
    ConfigField("first_k_dense_replace", INT, minimum=0, families=_DEEPSEEK),
    ConfigField("moe_layer_freq", INT, minimum=1, families=_DEEPSEEK),
    ConfigField("n_group", INT, minimum=1, families=_DEEPSEEK),
    ConfigField("topk_group", INT, minimum=1, families=_DEEPSEEK),
    ConfigField("norm_topk_prob", BOOL, families=_DEEPSEEK),
    ConfigField(
        "scoring_func",
        STR,
        supported=lambda v: v == "sigmoid",
        why="the router is built with sigmoid scores (the release's)",
        families=_DEEPSEEK,
    ),
    ConfigField(
        "topk_method",
        STR,
        supported=lambda v: v == "noaux_tc",
        why="the router is built as noaux_tc: group-limited top-k with e_score_correction_bias",
        families=_DEEPSEEK,
    ),
    ConfigField("routed_scaling_factor", NUMBER, minimum=1e-30, families=_DEEPSEEK),
    # Multi-token-prediction modules: not part of the target's forward; their weights are skipped by name.
    ConfigField("num_nextn_predict_layers", INT, minimum=0, families=_DEEPSEEK),
    ConfigField(
        "quantization_config",
        DICT,
        supported=_fp8_blocks,
        why="only block-scaled e4m3 FP8 (quant_method fp8 with weight_block_size [rows, cols]) is dequantized at load",
        families=_DEEPSEEK,
    ),
)

FIELDS: tuple[ConfigField, ...] = (
    ConfigField("num_hidden_layers", INT, required=True, minimum=1),
    ConfigField("hidden_size", INT, required=True, minimum=1),
    ConfigField("intermediate_size", INT, required=True, minimum=1),
    ConfigField("num_attention_heads", INT, required=True, minimum=1),
    ConfigField("num_key_value_heads", INT, minimum=1),
    ConfigField("head_dim", INT, minimum=1),
    ConfigField("vocab_size", INT, required=True, minimum=1),
    ConfigField("max_position_embeddings", INT, minimum=1),
    ConfigField("rms_norm_eps", NUMBER, minimum=1e-30),
    ConfigField("rope_theta", NUMBER, minimum=1e-30),
    ConfigField("rope_scaling", DICT),
    ConfigField("rope_parameters", DICT),
    ConfigField("rotary_dim", INT, minimum=0),
    ConfigField("tie_word_embeddings", BOOL),
    ConfigField(
        "torch_dtype",
        STR,
        supported=lambda v: v.replace("torch.", "") in CHECKPOINT_DTYPES,
        why=f"one of {CHECKPOINT_DTYPES}",
    ),
    ConfigField(
        "dtype",
        STR,
        supported=lambda v: v.replace("torch.", "") in CHECKPOINT_DTYPES,
        why=f"one of {CHECKPOINT_DTYPES}",
    ),
    ConfigField(
        "hidden_act",
        STR,
        supported=lambda v: v == "silu",
        why="the MLP is built as SwiGLU (a silu gate); another activation is not implemented",
        skip_families=_GEMMA3,  # Gemma reads hidden_activation
    ),
    ConfigField(
        "mlp_bias",
        BOOL,
        supported=_false,
        why="biases on gate_proj/up_proj/down_proj are not implemented, so they would never be read",
    ),
    ConfigField(
        "attention_bias",
        BOOL,
        supported=_false,
        why="biases on q_proj/k_proj/v_proj/o_proj are not implemented (the o_proj bias would never be read)",
        skip_families=_GLM_GPTOSS,
    ),
    ConfigField("use_sliding_window", BOOL, supported=_false, why=_NO_SLIDING, families=_QWEN3),
    ConfigField("sliding_window", INT, minimum=1, families=_QWEN3),  # read only under use_sliding_window
    ConfigField("max_window_layers", INT, minimum=0, families=_QWEN3),
    ConfigField("layer_types", LIST, supported=_full_attention, why=_NO_SLIDING, skip_families=_WINDOWED),
    # Mistral, Gemma 3 and gpt-oss: sliding windows; then Gemma's block.
    ConfigField("sliding_window", INT, minimum=1, families=_WINDOWED),
    ConfigField(
        "layer_types",
        LIST,
        supported=_window_layer_types,
        why="each layer is sliding_attention or full_attention",
        families=_WINDOWED,
    ),
    ConfigField(
        "hidden_activation",
        STR,
        supported=lambda v: v == "gelu_pytorch_tanh",
        why="the gated MLP is built with the tanh-approximated GELU (GeGLU); another activation is not implemented",
        families=_GEMMA3,
    ),
    ConfigField("query_pre_attn_scalar", NUMBER, minimum=1e-30, families=_GEMMA3),
    ConfigField("rope_local_base_freq", NUMBER, minimum=1e-30, families=_GEMMA3),
    ConfigField(
        "attn_logit_softcapping",
        NUMBER,
        supported=lambda v: False,
        why="attention-logit softcapping is not implemented (Gemma 3 publishes null)",
        families=_GEMMA3,
    ),
    ConfigField(
        "final_logit_softcapping",
        NUMBER,
        supported=lambda v: False,
        why="final-logit softcapping is not implemented (Gemma 3 publishes null)",
        families=_GEMMA3,
    ),
    ConfigField(
        "use_bidirectional_attention",
        BOOL,
        supported=_false,
        why="bidirectional attention is not implemented: the target is causal",
        families=_GEMMA3,
    ),
    ConfigField("pretraining_tp", INT, minimum=1),  # the same product, computed in slices
    # Mixture of experts.
    ConfigField("num_experts", INT, minimum=1, families=("qwen3_moe",)),
    ConfigField("num_local_experts", INT, minimum=1, families=("qwen3_moe", "minimax_m2")),
    ConfigField("num_experts_per_tok", INT, required=True, minimum=1, families=("qwen3_moe", "minimax_m2")),
    ConfigField("moe_intermediate_size", INT, required=True, minimum=1, families=("qwen3_moe",)),
    ConfigField("norm_topk_prob", BOOL, families=("qwen3_moe",)),
    ConfigField("decoder_sparse_step", INT, minimum=1, families=("qwen3_moe",)),
    ConfigField("mlp_only_layers", LIST, families=("qwen3_moe",)),
    ConfigField("scoring_func", STR, families=("minimax_m2",)),
    ConfigField("shared_intermediate_size", INT, minimum=0, families=("minimax_m2",)),
    ConfigField("use_routing_bias", BOOL, families=("minimax_m2",)),
    ConfigField("routed_scaling_factor", NUMBER, families=("minimax_m2",)),
    ConfigField("use_qk_norm", BOOL, families=("minimax_m2",)),
    ConfigField("qk_norm_type", STR, families=("minimax_m2",)),
    ConfigField("attn_type_list", LIST, families=("minimax_m2",)),
    # GLM-4.5 and gpt-oss (base/arch_glm_gptoss.py): q/k/v biases on both, o_proj's too on gpt-oss.
    ConfigField("attention_bias", BOOL, families=_GLM_GPTOSS),
    ConfigField("n_routed_experts", INT, required=True, minimum=1, families=_GLM),
    ConfigField("num_experts_per_tok", INT, required=True, minimum=1, families=_GLM_GPTOSS),
    ConfigField("moe_intermediate_size", INT, required=True, minimum=1, families=_GLM),
    ConfigField("n_shared_experts", INT, minimum=0, families=_GLM),
    ConfigField("routed_scaling_factor", NUMBER, minimum=1e-30, families=_GLM),
    ConfigField("n_group", INT, minimum=1, families=_GLM),
    ConfigField("topk_group", INT, minimum=1, families=_GLM),
    ConfigField("first_k_dense_replace", INT, minimum=0, families=_GLM),
    ConfigField("norm_topk_prob", BOOL, families=_GLM),
    ConfigField("use_qk_norm", BOOL, families=_GLM),
    ConfigField("partial_rotary_factor", NUMBER, minimum=1e-30, families=_GLM),
    # The multi-token-prediction layers stored after the last decoder layer: the target's forward never runs them.
    ConfigField("num_nextn_predict_layers", INT, minimum=0, families=_GLM),
    ConfigField("num_local_experts", INT, required=True, minimum=1, families=_GPTOSS),
    ConfigField("swiglu_limit", NUMBER, minimum=1e-30, families=_GPTOSS),
    ConfigField(
        "swiglu_alpha",
        NUMBER,
        supported=lambda v: v == 1.702,
        why="the experts' sigmoid slope is Megatron-Core's quick_gelu, fixed at 1.702",
        families=_GPTOSS,
    ),
    ConfigField(
        "quantization_config",
        DICT,
        supported=_mxfp4,
        why="gpt-oss checkpoints are read as bf16/fp32 or MXFP4 (quant_method mxfp4, dequantized at load)",
        families=_GPTOSS,
    ),
    *DEEPSEEK_V3_FIELDS,
)

# The keys of a llama3 rope_scaling, each a number (transformers' own _validate_llama3_parameters).
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _shown(value) -> str:
    """The value as config.json writes it (true, "false", [30]), cut short."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _json_kind(value) -> str:
    for kind in (BOOL, INT, NUMBER, STR, LIST, DICT):
        if _has_kind(value, kind):
            return {BOOL: "a boolean"}.get(kind, kind)
    return type(value).__name__


def _has_kind(value, kind: str) -> bool:
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {BOOL: bool, STR: str, LIST: list, DICT: dict}[kind])


def check_config_fields(config: dict[str, Any], model_type: str, source: str) -> None:
    """Refuse, naming the field, a config.json whose computation this project would not reproduce: a wrong
    type, a missing count, a value that is not implemented, heads that do not divide, incomplete llama3 RoPE."""
    for field in FIELDS:
        if (field.families and model_type not in field.families) or model_type in field.skip_families:
            continue
        value = config.get(field.name)
        if value is None:
            if field.required:
                raise ValueError(f"{source}: {field.name} is missing; a {model_type} config.json needs it.")
            continue
        if not _has_kind(value, field.kind):
            raise ValueError(f"{source}: {field.name} must be {field.kind}, not {_shown(value)} ({_json_kind(value)}).")
        if field.minimum is not None and value < field.minimum:
            raise ValueError(f"{source}: {field.name} {_shown(value)} must be at least {field.minimum:g}.")
        if field.supported is not None and not field.supported(value):
            raise ValueError(f"{source}: {field.name} {_shown(value)} is not supported: {field.why}.")
    _check_heads(config, source)
    _check_rope(config, source)


def _check_heads(config: dict[str, Any], source: str) -> None:
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    kv_heads = config.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ValueError(
            f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}; "
            f"grouped-query attention shares each key/value head among a whole number of query heads."
        )
    if not config.get("head_dim") and hidden % heads:
        raise ValueError(
            f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} and no head_dim "
            f"is given; the head size is undefined."
        )


def _check_rope(config: dict[str, Any], source: str) -> None:
    for name in ("rope_parameters", "rope_scaling"):
        rope = config.get(name) or {}
        if rope.get("rope_type", rope.get("type")) != "llama3":
            continue
        for key in LLAMA3_ROPE_KEYS:
            if not _has_kind(rope.get(key), NUMBER):
                found = "is missing" if rope.get(key) is None else f"is {_shown(rope[key])}, not a number"
                raise ValueError(f"{source}: {name}.{key} {found}; llama3 RoPE scaling needs {LLAMA3_ROPE_KEYS}.")
