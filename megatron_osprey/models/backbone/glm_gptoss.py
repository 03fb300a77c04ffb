"""What GLM-4.5 and gpt-oss add to the Megatron-Core GPT model: config fields, and two spec swaps.

Megatron-Core 0.16.1 holds almost all of it: shared experts, dense-then-MoE stacks (moe_layer_freq), group-limited
sigmoid routing with an expert bias and a scaling factor, learned attention sinks (softmax_type="learnable", one
logit per head appended to the softmax), sliding windows per layer (window_size + window_attn_skip_freq), biases on
the router and the experts (add_bias_linear, at expert-tensor-parallel size 1), and gpt-oss's clamped SwiGLU
(quick_gelu = x sigmoid(1.702 x), glu_linear_offset 1 for the (up + 1) term, activation_func_clamp_value).

What it lacks, written here:
- YaRN on a standard (non-MLA) attention: the inverse frequencies are HF's (yarn_inv_freq, set on the model's
  RotaryEmbedding as for llama3), and YaRN's cos/sin multiplier m is folded into the softmax scale as m^2.
- The local spec's sliding window builds its mask with device="cuda" (transformer/utils.py
  get_sliding_window_causal_mask): models/backbone/sliding_window.py builds the same mask on the scores' device.
  The window's config fields and spec swap are shared with Mistral and Gemma 3 (models/backbone/dense_variants.py).
"""

from __future__ import annotations

import math

import torch

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.base.arch_glm_gptoss import yarn_attention_factor


def family_config_kwargs(arch: ModelArch, expert_tensor_parallel_size: int) -> dict:
    """TransformerConfig fields for GLM-4.5 / gpt-oss features (empty for the other families)."""
    kwargs: dict = {}
    if arch.linear_bias:
        if arch.is_moe and expert_tensor_parallel_size != 1:
            raise ValueError(
                f"{arch.family}'s experts carry biases, which Megatron-Core supports at expert tensor parallel size "
                f"1 only: set --expert-tensor-parallel-size 1 (got {expert_tensor_parallel_size})."
            )
        kwargs["add_bias_linear"] = True
    if arch.attention_sinks:
        kwargs["softmax_type"] = "learnable"
    if arch.activation == "clamped_swiglu":
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        kwargs.update(activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=arch.swiglu_limit)
    factor = yarn_attention_factor(arch.rope_scaling)
    if factor != 1.0:
        # HF multiplies cos and sin by `factor`: both q and k grow by it, the scores by its square.
        kwargs["softmax_scale"] = factor**2 / math.sqrt(arch.head_dim)
    return kwargs


def yarn_inv_freq(arch: ModelArch) -> torch.Tensor:
    """YaRN inverse frequencies as HF computes them: interpolated (/ factor) below the beta_slow rotation count,
    original above beta_fast, a linear ramp between (floor/ceil of the ramp's ends when `truncate`)."""
    scaling = arch.rope_scaling
    dim, base = arch.rotary_dim or arch.head_dim, arch.rope_theta
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    interpolation = extrapolation / scaling["factor"]
    keep = 1 - ramp  # share of the original frequency
    return interpolation * (1 - keep) + extrapolation * keep


def decoder_spec(arch: ModelArch, transformer_impl: str, config, spec, vp_stage: int | None = None):
    """`spec` (one layer's) or, for a dense-then-MoE stack, the block spec of this stage's layers. (Sliding windows,
    gpt-oss's too, are models/backbone/dense_variants.py's: variant_config_kwargs and variant_layer_spec.)"""
    if arch.dense_layer_count:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=transformer_impl == "transformer_engine", normalization="RMSNorm",
            vp_stage=vp_stage,
        )  # fmt: skip
    return spec
