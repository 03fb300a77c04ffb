"""A Megatron-Core GPTModel built from a HF config of any family in base/arch.SUPPORTED_FAMILIES (GLM-4.5's and
gpt-oss's additions: models/backbone/glm_gptoss.py; Qwen2's, Mistral's and Gemma 3's swaps:
models/backbone/dense_variants.py; DeepSeek-V3's attention: models/backbone/mla.py)."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.base.hardware import transformer_engine_usable
from megatron_osprey.models.backbone.config import TRANSFORMER_IMPLS  # noqa: E402,F401
from megatron_osprey.models.backbone.glm_gptoss import decoder_spec, family_config_kwargs, yarn_inv_freq
from megatron_osprey.models.backbone.gpu_support import fusions_usable, refuse_without_transformer_engine
from megatron_osprey.models.backbone.mla import local_mla_build, mla_block_spec, mla_config_kwargs
from megatron_osprey.parallel import ParallelConfig


def have_fused_softmax() -> bool:
    """True when Megatron-Core's fused masked softmax can run: CUDA and apex's softmax kernels.

    masked_softmax_fusion makes megatron-core import apex's `scaled_masked_softmax_cuda` /
    `scaled_upper_triang_masked_softmax_cuda` at the first step; the `gpu` extra installs TE, not apex.
    """
    import importlib.util

    kernels = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda")
    return torch.cuda.is_available() and all(importlib.util.find_spec(name) is not None for name in kernels)


def resolve_transformer_impl(requested: str = "auto") -> str:
    """`auto` picks Transformer Engine when TE and CUDA are present, the local spec otherwise."""
    if requested not in TRANSFORMER_IMPLS:
        raise ValueError(f"--transformer-impl must be one of {TRANSFORMER_IMPLS}, got {requested!r}.")
    te_usable = transformer_engine_usable()
    if requested == "auto":
        return "transformer_engine" if te_usable else "local"
    if requested == "transformer_engine" and not te_usable:
        raise RuntimeError(
            "--transformer-impl transformer_engine needs CUDA and Transformer Engine "
            "(pip install -e '.[gpu]' on a GPU machine); use --transformer-impl local on CPU."
        )
    return requested


def layer_spec(arch: ModelArch, transformer_impl: str):
    """The decoder layer spec: TE or local, chosen by swapping specs."""
    from megatron.core.models.gpt import gpt_layer_specs

    experts = arch.num_experts or None
    if transformer_impl == "transformer_engine":
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=arch.is_moe, qk_layernorm=arch.qk_layernorm
        )
    else:
        # Grouped GEMM needs TE or the grouped_gemm CUDA kernels: SequentialMLP on the CPU.
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=experts,
            moe_grouped_gemm=False,
            qk_layernorm=arch.qk_layernorm,
            normalization="RMSNorm",
        )
    if arch.qk_norm_over_projection:
        spec = _with_projection_qk_norm(spec)
    from megatron_osprey.models.backbone.dense_variants import needs_variant_spec, variant_layer_spec

    if needs_variant_spec(arch):
        spec = variant_layer_spec(spec, arch, transformer_impl, local_inv_freq=_local_inv_freq(arch))
    return spec


def _local_inv_freq(arch: ModelArch) -> torch.Tensor | None:
    """The sliding layers' own RoPE frequencies (Gemma 3's rope_local_base_freq, unscaled), when they differ."""
    if not arch.local_rope_theta:
        return None

    return rotary_inv_freq(dataclasses.replace(arch, rope_theta=arch.local_rope_theta, rope_scaling=None))


def _with_projection_qk_norm(spec):
    """Swap the per-head q/k norms for RMSNorms over the whole projection (MiniMax-M2)."""
    import copy

    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_osprey.models.backbone.qk_norm import ProjectionRMSNorm

    spec = copy.deepcopy(spec)
    attention = spec.submodules.self_attention.submodules
    attention.q_layernorm = ModuleSpec(module=ProjectionRMSNorm, params={"role": "query"})
    attention.k_layernorm = ModuleSpec(module=ProjectionRMSNorm, params={"role": "key"})
    return spec


def moe_config_kwargs(arch: ModelArch) -> dict:
    """TransformerConfig moe_* fields for `arch`'s router and experts (inference: no aux loss)."""
    if not arch.is_moe:
        return {}
    kwargs = dict(
        num_moe_experts=arch.num_experts,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_topk=arch.moe_router_topk,
        moe_router_score_function=arch.moe_score_function,
        moe_router_enable_expert_bias=arch.moe_expert_bias,
        moe_router_topk_scaling_factor=arch.moe_topk_scaling_factor,
        # HF routes in float32 whatever the weights' dtype.
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
    )
    if arch.moe_shared_expert_ffn_hidden_size:
        kwargs["moe_shared_expert_intermediate_size"] = arch.moe_shared_expert_ffn_hidden_size
    if arch.moe_router_num_groups:
        kwargs["moe_router_num_groups"] = arch.moe_router_num_groups
        kwargs["moe_router_group_topk"] = arch.moe_router_group_topk
    if arch.moe_layer_pattern is not None:
        kwargs["moe_layer_freq"] = list(arch.moe_layer_pattern)
    if arch.moe_score_function == "softmax":
        # Softmax over the top-k logits equals renormalized top-k probabilities
        # (norm_topk_prob); softmax over all experts first keeps them unnormalized.
        kwargs["moe_router_pre_softmax"] = not arch.moe_norm_topk_prob
    return kwargs


def transformer_config(
    arch: ModelArch,
    parallel: ParallelConfig,
    *,
    params_dtype: torch.dtype | None = None,
    perform_initialization: bool = True,
    **overrides,
):
    """TransformerConfig for `arch` under `parallel`; fusions stay off on CPU."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    arch.validate_parallel(
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.expert_model_parallel_size,
    )
    dtype = params_dtype or torch.float32
    on_gpu = torch.cuda.is_available()
    fusions = fusions_usable(on_gpu)
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=float(arch.hf_config.get("initializer_range", 0.02)),
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=(parallel.expert_tensor_parallel_size or parallel.tensor_model_parallel_size),
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        use_cpu_initialization=not on_gpu,
        perform_initialization=perform_initialization,
        bias_activation_fusion=fusions,
        bias_dropout_fusion=fusions,
        masked_softmax_fusion=have_fused_softmax(),
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        # gloo matches isend/irecv to one peer in posting order: batching swaps activations.
        batch_p2p_comm=on_gpu,
    )
    kwargs.update(moe_config_kwargs(arch))
    kwargs.update(family_config_kwargs(arch, kwargs["expert_tensor_parallel_size"]))
    if arch.mla is not None:
        kwargs.update(mla_config_kwargs(arch))

    from megatron_osprey.models.backbone.dense_variants import variant_config_kwargs

    kwargs.update(variant_config_kwargs(arch))
    kwargs.update(overrides)
    return (MLATransformerConfig if arch.mla is not None else TransformerConfig)(**kwargs)


def build_gpt_model(
    arch: ModelArch,
    parallel: ParallelConfig,
    *,
    transformer_impl: str = "auto",
    params_dtype: torch.dtype | None = None,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    vp_stage: int | None = None,
    perform_initialization: bool = True,
    **config_overrides,
):
    """Build this rank's GPTModel stage for `arch` (needs initialized model-parallel state)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel

    from megatron_osprey.models.backbone.dense_variants import local_spec_only, scale_embedding, variant_block_spec

    impl = resolve_transformer_impl(transformer_impl)
    if transformer_impl == "auto" and local_spec_only(arch):
        impl = "local"  # Gemma 3's block exists on the local spec only (models/backbone/dense_variants.py)
    refuse_without_transformer_engine(
        is_moe=arch.is_moe,
        sequence_parallel=parallel.sequence_parallel,
        transformer_impl=impl,
        cuda_available=torch.cuda.is_available(),
    )
    if arch.is_moe and impl == "transformer_engine":
        config_overrides.setdefault("moe_grouped_gemm", True)
    config = transformer_config(
        arch,
        parallel,
        params_dtype=params_dtype,
        perform_initialization=perform_initialization,
        **config_overrides,
    )
    if pre_process is None:
        pre_process = mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    with local_mla_build(impl if arch.mla is not None else "transformer_engine"):
        model = GPTModel(
            config=config,
            transformer_layer_spec=(
                variant_block_spec(
                    decoder_spec(arch, impl, config, layer_spec(arch, impl), vp_stage), arch, config, vp_stage
                )
                if arch.mla is None
                else mla_block_spec(config, impl)
            ),
            vocab_size=arch.padded_vocab_size(parallel.tensor_model_parallel_size),
            max_sequence_length=arch.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=arch.rotary_percent,
            rotary_base=int(arch.rope_theta),
            vp_stage=vp_stage,
        )
    # HF's exact inverse frequencies (llama3 scaling with its own factors, float theta); MLA builds its own YaRN.
    if arch.mla is None:
        rotary = model.rotary_pos_emb
        rotary.inv_freq = rotary_inv_freq(arch).to(rotary.inv_freq.device)
    scale_embedding(model, arch)
    model.osprey_arch = arch
    model.transformer_impl = impl
    return model


def rotary_inv_freq(arch: ModelArch) -> torch.Tensor:
    """RoPE inverse frequencies exactly as the HF model computes them (default, llama3 or YaRN)."""
    if arch.rope_scaling is not None and arch.rope_scaling.get("rope_type") == "yarn":
        return yarn_inv_freq(arch)
    dim = arch.rotary_dim or arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if arch.rope_scaling is None:
        return inv_freq
    if arch.rope_scaling.get("rope_type") == "linear":
        return inv_freq / float(arch.rope_scaling["factor"])
    factor = float(arch.rope_scaling["factor"])
    low = float(arch.rope_scaling["low_freq_factor"])
    high = float(arch.rope_scaling["high_freq_factor"])
    old_len = float(arch.rope_scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
