"""DeepSeek-V3 / Kimi-K2 in Megatron-Core: MLATransformerConfig fields and the decoder block spec.

Megatron-Core 0.16.1 holds what this architecture needs: MLASelfAttention (q/kv low-rank projections with their
latent RMSNorms, the decoupled RoPE part), YarnRotaryEmbedding with mscale / mscale_all_dim, shared experts
(SharedExpertMLP), sigmoid routing with an expert bias and group-limited top-k, a routed scaling factor, and a
per-layer dense / MoE pattern (moe_layer_freq as a list). What it lacks, and where this project supplies it:
- RoPE channels stored as halves (rope_interleave false): Megatron-Core's MLA de-interleaves the rope part itself
  (the release's layout); such checkpoints' rope rows are read interleaved (convert/deepseek_v3.py);
- the group score of group-limited routing is the sum of the best topk / group_topk experts, HF's the best 2:
  equal for the released configs (8 = 2 x 4; Kimi-K2 has one group), other combinations are refused
  (base/deepseek_v3.py);
- the latent norms' eps: Megatron-Core uses the layer eps, the release 1e-6; a config with another
  rms_norm_eps is refused (base/deepseek_v3.py);
- a local (non-TE) core attention whose keys and values differ in width: Megatron-Core's MLA passes k_channels /
  v_channels, which only TEDotProductAttention takes; MLADotProductAttention below is the local one (CPU, tests);
- building MLA without Transformer Engine at all (local_mla_build below);
- multi-token-prediction modules are not built (the target forward never runs them); convert/deepseek_v3.py
  names their weights as skipped.
"""

from __future__ import annotations

import contextlib

from megatron_osprey.base.arch import ModelArch


def mla_config_kwargs(arch: ModelArch) -> dict:
    """The MLATransformerConfig fields of `arch` (rotary fusion off: unfused YaRN is what runs on CPU)."""
    mla = arch.mla
    kwargs = dict(
        multi_latent_attention=True,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim,
        qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        kv_channels=mla.qk_head_dim,
        # The latent norms (q_a_layernorm, kv_a_layernorm) are the spec's q / kv layernorms.
        qk_layernorm=True,
        rotary_base=arch.rope_theta,
        rope_type="yarn" if mla.rope_type == "yarn" else "rope",
        rotary_scaling_factor=mla.yarn_factor,
        original_max_position_embeddings=mla.yarn_original_max_position_embeddings,
        beta_fast=mla.yarn_beta_fast,
        beta_slow=mla.yarn_beta_slow,
        mscale=mla.yarn_mscale,
        mscale_all_dim=mla.yarn_mscale_all_dim,
        apply_rope_fusion=False,
    )
    if mla.rope_type != "yarn":
        kwargs.update(rotary_scaling_factor=1.0, mscale_all_dim=0.0)
    return kwargs


def builds_mla_without_query_latent() -> bool:
    """Whether megatron-core builds MLA with q_lora_rank null as the release has it (one plain q_proj). From 0.19 on
    its QK-norm resolver (transformer/mla_qk_norm_config.py) replaces that q_proj, with qk_layernorm set (the
    latent kv norm needs it), by a fused norm+linear."""
    import importlib.util

    return importlib.util.find_spec("megatron.core.transformer.mla_qk_norm_config") is None


def mla_block_spec(config, transformer_impl: str):
    """The decoder block spec: MLA in every layer, dense or MoE MLP per the config's moe_layer_freq list."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    if config.q_lora_rank is None and not builds_mla_without_query_latent():
        raise ValueError(
            "an MLA target without a query latent (q_lora_rank null) needs megatron-core 0.18.x or earlier: this "
            "megatron-core (mla_qk_norm_config) puts a norm in front of the query projection, which the release's "
            "attention has not"
        )
    te = transformer_impl == "transformer_engine"
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm")
    if not te:
        spec = copy.deepcopy(spec)
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = ModuleSpec(module=MLADotProductAttention)
    return spec


@contextlib.contextmanager
def local_mla_build(transformer_impl: str):
    """Around building an MLA model with the local spec where Transformer Engine is absent: megatron-core 0.16.1's
    extensions module then stands TE's classes in with MagicMocks, and MultiLatentAttention's
    `isinstance(self.linear_proj, TELinear)` raises TypeError; its HAVE_TE is cleared for the build, then restored."""
    from megatron.core.transformer import multi_latent_attention as mla_module

    stand_in = mla_module.HAVE_TE and not isinstance(mla_module.TELinear, type)
    if transformer_impl == "transformer_engine" or not stand_in:
        yield
        return
    mla_module.HAVE_TE = False
    try:
        yield
    finally:
        mla_module.HAVE_TE = True


def _local_attention_base():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


class MLADotProductAttention(_local_attention_base()):
    """Megatron-Core's local DotProductAttention with keys k_channels wide and values v_channels wide."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        # The context is heads x v_channels wide (the base class assumes kv_channels for both).
        self.hidden_size_per_partition = self.num_attention_heads_per_partition * (v_channels or config.kv_channels)
