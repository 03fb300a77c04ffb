"""The architecture facts of a HF decoder-only LM, normalized across families.

Dense: Qwen3, Llama-3.x, Qwen2 (Qwen2.5), Mistral, Gemma 3 (base/dense_families.py). Mixture of experts:
Qwen3-MoE (softmax router, optional renormalized top-k), MiniMax-M2/M2.5 (sigmoid router with a score-correction
bias, partial rotary, and q/k RMSNorm over the whole projection rather than per head), GLM-4.5 and gpt-oss
(base/arch_glm_gptoss.py), DeepSeek-V3 / Kimi-K2 (base/deepseek_v3.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from megatron_osprey.base.arch_glm_gptoss import FAMILY_FIELDS
from megatron_osprey.base.config_fields import check_config_fields
from megatron_osprey.base.dense_families import dense_variant_fields, family_config
from megatron_osprey.base.rope_config import rope_fields

# model_type in config.json -> (family, HF class name)
SUPPORTED_FAMILIES: dict[str, str] = {
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    # Multi-latent attention with shared experts (base/deepseek_v3.py); Kimi-K2 is the same architecture.
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",  # its text_config: the language model
}


def padded_size(size: int, tensor_parallel_size: int, divisible_by: int = 128) -> int:
    """Megatron's table padding: `size` rounded up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tensor_parallel_size
    return -(-size // multiple) * multiple


def looks_like_hub_id(text: str) -> bool:
    """`org/name` with nothing on disk there: a Hugging Face Hub id, which this project never downloads."""
    parts = str(text).split("/")
    return len(parts) == 2 and all(parts) and not str(text).startswith((".", "~")) and not Path(text).exists()


def hf_config_file(path: str | Path, what: str = "config", missing_ok: bool = False) -> Path | None:
    """PATH/config.json (or PATH itself, a config.json); a Hub id or a missing file is refused by name."""
    if looks_like_hub_id(str(path)):
        raise ValueError(
            f"{what} {path} looks like a Hugging Face Hub id; nothing is downloaded here: download the model "
            f"first (e.g. `huggingface-cli download {path} --local-dir DIR`) and pass DIR."
        )
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if file.is_file():
        return file
    if missing_ok:
        return None
    raise FileNotFoundError(f"{what} {path}: no config.json there (expected a HF model directory).")


# The target layers whose hidden states feed the drafter (EAGLE-3's fusion takes exactly three).
def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """SGLang's default taps: [1, L//2 - 1, L - 4] (0-based)."""
    ids = [1, num_target_layers // 2 - 1, num_target_layers - 4]
    if num_target_layers < 5 or len(set(ids)) != 3:
        raise ValueError(f"a target with {num_target_layers} layers has no default --aux-layer-ids; pass three ids.")
    return ids


def validate_aux_layer_ids(aux_layer_ids: list[int], num_target_layers: int) -> list[int]:
    """Three distinct ids in [0, L); one clear error otherwise."""
    ids = [int(i) for i in aux_layer_ids]
    if len(ids) != 3 or len(set(ids)) != 3 or any(not 0 <= i < num_target_layers for i in ids):
        raise ValueError(
            f"--aux-layer-ids {ids} must be three distinct layer ids in 0..{num_target_layers - 1} "
            f"(the target has {num_target_layers} layers)."
        )
    return ids


def resolve_aux_layer_ids(requested: list[int] | tuple[int, ...] | None, num_target_layers: int) -> list[int]:
    """The requested ids (or the default taps when none are given), validated."""
    return validate_aux_layer_ids(requested or default_aux_layer_ids(num_target_layers), num_target_layers)


@dataclasses.dataclass(frozen=True)
class ModelArch:
    """What Megatron-Core needs to rebuild a Qwen3 / Llama model from its HF config."""

    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    qk_layernorm: bool
    qkv_bias: bool
    tie_word_embeddings: bool
    torch_dtype: str
    hf_config: dict[str, Any] = dataclasses.field(repr=False, compare=False, hash=False)
    # Mixture of experts (num_experts == 0: dense MLP).
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    moe_score_function: str = "softmax"  # or "sigmoid"
    moe_norm_topk_prob: bool = True  # renormalize the top-k scores to sum to 1
    moe_expert_bias: bool = False  # a routing-only bias added to the scores (e_score_correction_bias)
    moe_topk_scaling_factor: float | None = None
    # RoPE on the first rotary_dim channels of each head (0: the whole head).
    rotary_dim: int = 0
    # "head": one RMSNorm per head (Qwen3); "projection": over all heads at once (MiniMax-M2).
    qk_norm_scope: str = "head"
    # Multi-latent attention (DeepSeek-V3 / Kimi-K2, base/deepseek_v3.py); None: q/k/v projections.
    mla: Any = None  # deepseek_v3.MLAShape
    # 1 for a mixture-of-experts layer, 0 for a dense one (None: every layer of a MoE model is MoE).
    moe_layer_pattern: tuple[int, ...] | None = None
    moe_shared_expert_ffn_hidden_size: int = 0  # 0: no shared expert
    moe_router_num_groups: int = 0  # group-limited routing: experts in this many groups (0: none) ...
    moe_router_group_topk: int = 0  # ... of which this many are kept per token
    # gpt-oss / GLM-4.5 (base/arch_glm_gptoss.py); the defaults are every other family's.
    linear_bias: bool = False  # biases on o_proj, the router and the experts (gpt-oss)
    attention_sinks: bool = False  # a learned logit per head beside the keys (gpt-oss)
    activation: str = "swiglu"  # the GLU's form, or "clamped_swiglu" (gpt-oss: clamped gate/up, slope 1.702, up + 1)
    swiglu_limit: float = 0.0
    mtp_layers: int = 0  # multi-token-prediction layers in the checkpoint: never read
    # Qwen2 / Mistral / Gemma 3 (base/dense_families.py); the defaults are the Llama block.
    hidden_act: str = "silu"  # the gated MLP's gate activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    # Sliding windows (Mistral, Gemma 3, gpt-oss): a sliding layer attends to the last `sliding_window` positions
    # (itself included); which layers slide is `layer_types` alone (sliding_layers / sliding_layer_flags derive).
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()  # per layer "sliding_attention" / "full_attention"; (): all full
    local_rope_theta: float = 0.0  # RoPE base of the sliding layers (0: rope_theta)
    zero_centered_norm: bool = False  # RMSNorms multiply by (1 + w)
    sandwich_norms: bool = False  # norms after attention and after the MLP too
    embedding_multiplier: float = 1.0  # token embeddings scaled by this (Gemma: sqrt(hidden))
    softmax_scale: float | None = None  # attention scores scale (None: head_dim ** -0.5)

    @classmethod
    def from_hf_config(cls, config: Any, source: str = "config.json") -> "ModelArch":
        """Build from a transformers config object, a dict, or a path to config.json / its directory."""
        if isinstance(config, (str, Path)):
            path = hf_config_file(config, "HF config")
            source = str(path)
            config = _read_json(path)
        if not isinstance(config, dict):
            config = config.to_dict()
        config = dict(config)
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"{source}: unsupported architecture model_type={model_type!r} "
                f"(architectures={config.get('architectures')}); supported: "
                f"{', '.join(sorted(SUPPORTED_FAMILIES))}."
            )
        config = family_config(config, model_type, source)
        check_config_fields(config, model_type, source)  # every field below has its type and a supported value
        from megatron_osprey.base import deepseek_v3

        if model_type in deepseek_v3.MLA_MODEL_TYPES:
            return cls(**deepseek_v3.deepseek_v3_fields(config, source))
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
        head_dim = int(config.get("head_dim") or hidden // heads)
        moe = _moe_fields(config, model_type, source)
        rope = rope_fields(config, model_type, head_dim, source)
        qk_layernorm, scope = _qk_norm(config, model_type, source)
        variant = {"qkv_bias": bool(config.get("attention_bias", False))}
        variant.update(dense_variant_fields(config, model_type, source))
        return cls(
            family=model_type,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            ffn_hidden_size=int(config["intermediate_size"]),
            num_attention_heads=heads,
            num_query_groups=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            qk_layernorm=qk_layernorm,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            torch_dtype=str(dtype).replace("torch.", ""),
            hf_config=config,
            qk_norm_scope=scope,
            **rope,
            **moe,
            **variant,
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def dense_layer_count(self) -> int:
        """Layers with a dense MLP in a mixture-of-experts stack (moe_layer_pattern's zeros)."""
        return 0 if self.moe_layer_pattern is None else self.moe_layer_pattern.count(0)

    @property
    def is_dense(self) -> bool:
        return self.num_experts == 0

    @property
    def rotary_percent(self) -> float:
        """Share of each head's channels that RoPE rotates (Megatron's rotary_percent)."""
        return 1.0 if not self.rotary_dim else self.rotary_dim / self.head_dim

    @property
    def qk_norm_over_projection(self) -> bool:
        return self.qk_layernorm and self.qk_norm_scope == "projection"

    @property
    def qk_norm_per_head(self) -> bool:
        return self.qk_layernorm and self.qk_norm_scope == "head"

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """0-based ids of the sliding-window layers (from layer_types; () without a window)."""
        return tuple(i for i, sliding in enumerate(self.sliding_layer_flags) if sliding)

    @property
    def sliding_layer_flags(self) -> list[bool]:
        """Per layer: does it attend through the sliding window."""
        if not self.sliding_window:
            return [False] * self.num_layers
        return [kind == "sliding_attention" for kind in self.layer_types] or [True] * self.num_layers

    @property
    def hf_architecture(self) -> str:
        return SUPPORTED_FAMILIES[self.family]

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def default_aux_layer_ids(self) -> list[int]:
        """The target layers EAGLE-3 / SGLang tap by default: [1, L//2 - 1, L - 4]."""
        return default_aux_layer_ids(self.num_layers)

    def shape(self) -> dict[str, Any]:
        """The facts a user checks against the model card: sizes, vocabulary, tying, RoPE and MoE layout."""
        shape: dict[str, Any] = {
            "family": self.family,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups,
            "head_dim": self.head_dim,
            "ffn_hidden_size": self.ffn_hidden_size,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rotary_dim": self.rotary_dim or self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "qk_norm": self.qk_norm_scope if self.qk_layernorm else None,
        }
        if self.sliding_window:
            sliding = self.sliding_layer_flags
            shape["sliding_window"] = {
                "window": self.sliding_window,
                "sliding_layers": sum(sliding),
                "full_layers": len(sliding) - sum(sliding),
                "local_rope_theta": self.local_rope_theta or self.rope_theta,
            }
        if self.is_moe:
            shape["moe"] = {
                "num_experts": self.num_experts,
                "router_topk": self.moe_router_topk,
                "expert_ffn_hidden_size": self.moe_ffn_hidden_size,
                "score_function": self.moe_score_function,
                "norm_topk_prob": self.moe_norm_topk_prob,
                "expert_bias": self.moe_expert_bias,
                "moe_layers": "all",
            }
        if self.moe_layer_pattern is not None:
            shape["moe"]["moe_layers"] = [i for i, moe in enumerate(self.moe_layer_pattern) if moe]
            shape["moe"]["shared_expert_ffn_hidden_size"] = self.moe_shared_expert_ffn_hidden_size
            shape["moe"]["router_groups"] = self.moe_router_num_groups
            shape["moe"]["router_group_topk"] = self.moe_router_group_topk
            shape["moe"]["topk_scaling_factor"] = self.moe_topk_scaling_factor
        if self.mla is not None:
            shape["mla"] = self.mla.shape()
        if self.attention_sinks:
            shape["attention_sinks"] = True
        if self.linear_bias:
            shape["linear_bias"] = True
        if self.activation != "swiglu":
            shape["activation"] = {"kind": self.activation, "limit": self.swiglu_limit}
        if self.mtp_layers:
            shape["mtp_layers_skipped"] = self.mtp_layers
        return shape

    def with_num_layers(self, num_layers: int) -> "ModelArch":
        """The same architecture truncated to its first `num_layers` blocks."""
        config = dict(self.hf_config, num_hidden_layers=num_layers)
        for key in ("layer_types", "max_window_layers"):
            if isinstance(config.get(key), list):
                config[key] = config[key][:num_layers]
        if isinstance(config.get("max_window_layers"), int):
            config["max_window_layers"] = min(config["max_window_layers"], num_layers)
        layer_types = self.layer_types[:num_layers]
        pattern = None if self.moe_layer_pattern is None else self.moe_layer_pattern[:num_layers]
        return dataclasses.replace(
            self, num_layers=num_layers, hf_config=config, moe_layer_pattern=pattern, layer_types=layer_types
        )

    def padded_vocab_size(self, tensor_parallel_size: int, divisible_by: int = 128) -> int:
        """Megatron's vocab padding: a multiple of divisible_by x TP."""
        return padded_size(self.vocab_size, tensor_parallel_size, divisible_by)

    def validate_parallel(
        self,
        tensor_parallel_size: int,
        pipeline_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        sequence_parallel: bool | None = None,
    ) -> None:
        """Raise one clear error when TP/PP/EP do not divide heads, kv-heads, FFN, layers or experts, or (given
        `sequence_parallel`) when a mixture-of-experts model runs at TP > 1 without it, as Megatron-Core needs."""
        tp, pp, ep = tensor_parallel_size, pipeline_parallel_size, expert_parallel_size
        checks = [
            ("num_attention_heads", self.num_attention_heads, tp, "--tensor-model-parallel-size"),
            ("num_key_value_heads", self.num_query_groups, tp, "--tensor-model-parallel-size"),
            ("num_hidden_layers", self.num_layers, pp, "--pipeline-model-parallel-size"),
        ]
        if self.is_moe:
            checks.append(("num_experts", self.num_experts, ep, "--expert-model-parallel-size"))
            if not self.linear_bias:  # biased experts run at expert-tensor-parallel size 1 (gpt-oss)
                checks.append(("moe_intermediate_size", self.moe_ffn_hidden_size, tp, "--tensor-model-parallel-size"))
            if self.mla is None and self.dense_layer_count:
                checks.append(("intermediate_size", self.ffn_hidden_size, tp, "--tensor-model-parallel-size"))
            if self.mla is None and self.moe_shared_expert_ffn_hidden_size:
                shared = self.moe_shared_expert_ffn_hidden_size
                checks.append(("shared expert width", shared, tp, "--tensor-model-parallel-size"))
        else:
            checks.append(("intermediate_size", self.ffn_hidden_size, tp, "--tensor-model-parallel-size"))
            if ep > 1:
                raise ValueError(
                    f"--expert-model-parallel-size {ep} needs a mixture-of-experts model; "
                    f"{self.family} is dense, use 1."
                )
        if self.mla is not None:
            from megatron_osprey.base import deepseek_v3

            checks += deepseek_v3.parallel_checks(self, tp)
        for name, value, size, flag in checks:
            if value % size:
                raise ValueError(
                    f"{flag} {size} does not divide the model's {name} ({value}); choose a size that divides {value}."
                )
        if sequence_parallel is False and self.is_moe and tp > 1:
            raise ValueError(
                "a mixture-of-experts target with --tensor-model-parallel-size > 1 needs --sequence-parallel."
            )

    def torch_dtype_obj(self):
        """The torch dtype of the checkpoint's weights (torch is imported here only: planning runs without it)."""
        import torch

        return getattr(torch, self.torch_dtype)

    def num_parameters(self) -> int:
        """Parameter count of the HF model (embedding counted once when tied)."""
        if self.mla is not None:
            from megatron_osprey.base import deepseek_v3

            return deepseek_v3.num_parameters(self)
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_query_groups * d
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0)
        if self.qk_norm_over_projection:
            attn += q + kv
        elif self.qk_layernorm:
            attn += 2 * d
        if self.linear_bias:
            attn += h  # o_proj bias
        if self.attention_sinks:
            attn += self.num_attention_heads
        dense_mlp = 3 * h * f
        if self.is_moe:
            mlp = self.num_experts * (3 * h * self.moe_ffn_hidden_size + h)  # experts + router rows
            mlp += self.num_experts if self.moe_expert_bias else 0
            mlp += 3 * h * self.moe_shared_expert_ffn_hidden_size
            if self.linear_bias:  # router bias, fc1 (gate and up) and fc2 biases
                mlp += self.num_experts * (1 + 2 * self.moe_ffn_hidden_size + h)
        else:
            mlp = dense_mlp
        norms = 4 * h if self.sandwich_norms else 2 * h
        dense = self.dense_layer_count if self.is_moe else 0
        layers = (self.num_layers - dense) * (attn + mlp + norms) + dense * (attn + dense_mlp + norms)
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else embed
        return layers + embed + head + h


def _read_json(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:  # RecursionError: brackets nested too deep to parse
        raise ValueError(f"{path} is not valid JSON ({type(exc).__name__}: {str(exc)[:120]}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(config).__name__}.")
    return config


def load_target_config(path: str | Path) -> ModelArch:
    """A target's architecture from its local config.json (PATH or its directory); the one parse to pass down.

    A Hub id is refused (download the model first), and so is a family not in SUPPORTED_FAMILIES, by its model_type.
    """
    return ModelArch.from_hf_config(hf_config_file(path, "target"))


def _moe_fields(config: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """The MoE ModelArch fields of a HF config (empty for dense families)."""
    if model_type in FAMILY_FIELDS:
        return FAMILY_FIELDS[model_type](config, source)
    if model_type == "qwen3_moe":
        sparse_step = int(config.get("decoder_sparse_step", 1))
        if config.get("mlp_only_layers") or sparse_step != 1:
            raise ValueError(
                f"{source}: Qwen3-MoE with dense layers (mlp_only_layers={config.get('mlp_only_layers')}, "
                f"decoder_sparse_step={sparse_step}) is not supported; every layer must be MoE."
            )
        return dict(
            # Released configs say num_experts; transformers 5 writes num_local_experts.
            num_experts=int(config.get("num_experts") or config["num_local_experts"]),
            moe_ffn_hidden_size=int(config["moe_intermediate_size"]),
            moe_router_topk=int(config["num_experts_per_tok"]),
            moe_score_function="softmax",
            moe_norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        )
    if model_type == "minimax_m2":
        if int(config.get("shared_intermediate_size") or 0):
            raise ValueError(
                f"{source}: MiniMax-M2 with a shared expert (shared_intermediate_size="
                f"{config['shared_intermediate_size']}) is not supported."
            )
        if config.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(
                f"{source}: MiniMax-M2 scoring_func {config['scoring_func']!r} is not supported (sigmoid)."
            )
        attn_types = config.get("attn_type_list")
        if attn_types and any(int(t) != 1 for t in attn_types):
            raise ValueError(f"{source}: MiniMax-M2 layers with linear attention (attn_type_list 0) are not supported.")
        scaling = config.get("routed_scaling_factor")
        return dict(
            num_experts=int(config.get("num_local_experts") or config["num_experts"]),
            moe_ffn_hidden_size=int(config["intermediate_size"]),
            moe_router_topk=int(config["num_experts_per_tok"]),
            moe_score_function="sigmoid",
            moe_norm_topk_prob=True,
            moe_expert_bias=bool(config.get("use_routing_bias", True)),
            moe_topk_scaling_factor=None if scaling in (None, 1, 1.0) else float(scaling),
        )
    return {}


def _qk_norm(config: dict[str, Any], model_type: str, source: str) -> tuple[bool, str]:
    """Whether q/k are RMS-normalized, and over what: one head, or the whole projection."""
    if model_type in ("qwen3", "qwen3_moe", "gemma3_text", "gemma3"):
        return True, "head"
    if model_type == "glm4_moe":
        return (True, "head") if config.get("use_qk_norm") else (False, "none")
    if model_type == "minimax_m2":
        if not config.get("use_qk_norm", True):
            return False, "none"
        kind = config.get("qk_norm_type", "per_layer")
        if kind == "per_layer":
            # One RMS over all heads' channels with a weight per channel (not per head).
            return True, "projection"
        if kind == "per_head":
            return True, "head"
        raise ValueError(f"{source}: MiniMax-M2 qk_norm_type {kind!r} is not supported (per_layer, per_head).")
    return False, "none"
