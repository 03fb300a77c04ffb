"""DeepSeek-V3 (and Kimi-K2, the same architecture under model_type kimi_k2): its config.json read into a ModelArch.

What the forward computes, from transformers' DeepseekV3ForCausalLM and the release's own modeling code:
- multi-latent attention: q = q_b(RMSNorm(q_a(x))) (or one q_proj when q_lora_rank is null), a shared compressed
  key/value latent kv_a(x) = [c_kv | k_rope], k/v = kv_b(RMSNorm(c_kv)); each head's query and key are
  [nope | rope] parts, qk_nope_head_dim + qk_rope_head_dim wide; values v_head_dim wide. The latent norms use eps
  1e-6 whatever rms_norm_eps says (the release's code builds them without it).
- RoPE on the rope part only, its channels stored as interleaved pairs (rope_interleave, the release's layout),
  YaRN-scaled (factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim), with the
  softmax scale multiplied by mscale(factor, mscale_all_dim)^2.
- the first first_k_dense_replace layers dense (intermediate_size), then mixture-of-experts layers every
  moe_layer_freq: n_routed_experts routed (moe_intermediate_size each) plus n_shared_experts shared ones that every
  token passes through, sigmoid scores, a routing-only e_score_correction_bias, group-limited top-k (n_group
  groups, topk_group of them kept, a group scored by the sum of its two best experts), the chosen scores
  renormalized (norm_topk_prob) and scaled by routed_scaling_factor.
- num_nextn_predict_layers multi-token-prediction modules (model.layers.{L}.*, after the L decoder layers) are not
  part of the target's forward: their weights are never read (convert/deepseek_v3.py lists them as skipped).

Torch-free: planning reads this on a login node.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# model_type values that are this architecture; Kimi-K2 ships architectures ["DeepseekV3ForCausalLM"].
MLA_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
FAMILY = "deepseek_v3"
# The eps the release's code gives q_a_layernorm and kv_a_layernorm (DeepseekV3RMSNorm's default).
LATENT_NORM_EPS = 1e-6
# HF scores a group by the sum of its 2 best experts; Megatron-Core by its best moe_router_topk / group_topk.
HF_GROUP_SCORE_TOPK = 2


@dataclasses.dataclass(frozen=True)
class MLAShape:
    """Multi-latent attention sizes and the YaRN RoPE of a DeepSeek-V3-class model."""

    q_lora_rank: int | None  # None: one q_proj from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    # YaRN (rope_type yarn); factor 1.0 with rope_type default means plain RoPE.
    rope_type: str = "default"
    yarn_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def attention_params(self, hidden: int, heads: int) -> int:
        """Parameters of one MLA block: projections and the two latent norms."""
        q = heads * self.qk_head_dim
        if self.q_lora_rank:
            params = hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * q
        else:
            params = hidden * q
        params += hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        params += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return params + heads * self.v_head_dim * hidden

    def shape(self) -> dict[str, Any]:
        return {
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "rope_interleave": self.rope_interleave,
            "rope_type": self.rope_type,
            "yarn": None
            if self.rope_type != "yarn"
            else {
                "factor": self.yarn_factor,
                "original_max_position_embeddings": self.yarn_original_max_position_embeddings,
                "beta_fast": self.yarn_beta_fast,
                "beta_slow": self.yarn_beta_slow,
                "mscale": self.yarn_mscale,
                "mscale_all_dim": self.yarn_mscale_all_dim,
            },
        }


def _rope(config: dict[str, Any], source: str) -> tuple[float, dict[str, Any]]:
    """(rope_theta, the MLAShape RoPE fields) from rope_scaling / rope_parameters."""
    rope = dict(config.get("rope_parameters") or {})
    rope.update(config.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, {"rope_type": "default"}
    if kind != "yarn":
        raise ValueError(f"{source}: rope_scaling type {kind!r} is not supported for DeepSeek-V3 (default, yarn).")
    if rope.get("attention_factor") is not None:
        raise ValueError(
            f"{source}: rope_scaling.attention_factor is not supported: Megatron-Core's YaRN derives it from "
            f"mscale and mscale_all_dim."
        )
    if rope.get("truncate") is False:
        raise ValueError(f"{source}: rope_scaling.truncate false is not supported (Megatron-Core rounds the range).")
    factor = rope.get("factor")
    if factor is None:
        factor = config["max_position_embeddings"] / rope["original_max_position_embeddings"]
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if not (mscale and mscale_all_dim) and mscale not in (None, 1, 1.0):
        # HF then uses mscale(factor) with mscale 1 for the cos/sin factor; Megatron-Core uses the given mscale.
        raise ValueError(
            f"{source}: rope_scaling.mscale {mscale} without mscale_all_dim is not supported "
            f"(transformers and Megatron-Core scale RoPE differently there)."
        )
    return theta, {
        "rope_type": "yarn",
        "yarn_factor": float(factor),
        "yarn_original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
        "yarn_beta_fast": float(rope.get("beta_fast", 32.0)),
        "yarn_beta_slow": float(rope.get("beta_slow", 1.0)),
        "yarn_mscale": float(mscale if mscale is not None else 1.0),
        "yarn_mscale_all_dim": float(mscale_all_dim or 0.0),
    }


def moe_layer_pattern(config: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """1 for a mixture-of-experts layer, 0 for a dense one: dense below first_k_dense_replace, then MoE every
    moe_layer_freq layers (the release's rule: layer_idx % moe_layer_freq == 0)."""
    first_dense = int(config.get("first_k_dense_replace") or 0)
    freq = int(config.get("moe_layer_freq") or 1)
    return tuple(int(i >= first_dense and i % freq == 0) for i in range(num_layers))


def _check(config: dict[str, Any], source: str) -> None:
    """The values this project's Megatron-Core model would not reproduce, refused by name."""
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"{source}: scoring_func {config['scoring_func']!r} is not supported (sigmoid).")
    if config.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(
            f"{source}: topk_method {config['topk_method']!r} is not supported (noaux_tc: group-limited top-k "
            f"with e_score_correction_bias)."
        )
    if config.get("norm_topk_prob", True) is not True and int(config.get("num_experts_per_tok") or 1) > 1:
        raise ValueError(
            f"{source}: norm_topk_prob false is not supported: Megatron-Core's sigmoid router always renormalizes "
            f"the chosen scores."
        )
    if float(config.get("rms_norm_eps", LATENT_NORM_EPS)) != LATENT_NORM_EPS:
        raise ValueError(
            f"{source}: rms_norm_eps {config['rms_norm_eps']} is not supported for DeepSeek-V3: the latent "
            f"q/kv norms use {LATENT_NORM_EPS} in the release's code and Megatron-Core builds them with the layer eps."
        )
    groups, group_topk = int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
    topk, experts = int(config["num_experts_per_tok"]), int(config["n_routed_experts"])
    if experts % groups:
        raise ValueError(f"{source}: n_group {groups} does not divide n_routed_experts {experts}.")
    if groups > 1 and (group_topk > groups or topk != HF_GROUP_SCORE_TOPK * group_topk):
        raise ValueError(
            f"{source}: n_group {groups} with topk_group {group_topk} and num_experts_per_tok {topk} is not "
            f"supported: a group is scored by its {HF_GROUP_SCORE_TOPK} best experts, which Megatron-Core "
            f"reproduces only when num_experts_per_tok = {HF_GROUP_SCORE_TOPK} x topk_group."
        )
    if int(config.get("n_routed_experts") or 0) < 1:
        raise ValueError(f"{source}: n_routed_experts must be at least 1.")


def deepseek_v3_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    """ModelArch keyword arguments of a DeepSeek-V3 / Kimi-K2 config.json (check_config_fields has run)."""
    _check(config, source)
    theta, rope = _rope(config, source)
    heads = int(config["num_attention_heads"])
    layers = int(config["num_hidden_layers"])
    q_lora = config.get("q_lora_rank")
    mla = MLAShape(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(config["kv_lora_rank"]),
        qk_nope_head_dim=int(config["qk_nope_head_dim"]),
        qk_rope_head_dim=int(config["qk_rope_head_dim"]),
        v_head_dim=int(config["v_head_dim"]),
        rope_interleave=bool(config.get("rope_interleave", True)),
        **rope,
    )
    groups = int(config.get("n_group") or 1)
    scaling = config.get("routed_scaling_factor")
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return dict(
        family=FAMILY,
        num_layers=layers,
        hidden_size=int(config["hidden_size"]),
        ffn_hidden_size=int(config["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=heads,  # every head has its own key and value, expanded from the shared latent
        head_dim=mla.qk_head_dim,
        rotary_dim=mla.qk_rope_head_dim,  # the rope part of each query / key head
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(config.get("rms_norm_eps", LATENT_NORM_EPS)),
        rope_theta=theta,
        rope_scaling=None,
        qk_layernorm=False,
        qkv_bias=False,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        torch_dtype=str(dtype).replace("torch.", ""),
        hf_config=config,
        num_experts=int(config["n_routed_experts"]),
        moe_ffn_hidden_size=int(config["moe_intermediate_size"]),
        moe_router_topk=int(config["num_experts_per_tok"]),
        moe_score_function="sigmoid",
        moe_norm_topk_prob=True,
        moe_expert_bias=True,
        moe_topk_scaling_factor=None if scaling in (None, 1, 1.0) else float(scaling),
        mla=mla,
        moe_layer_pattern=moe_layer_pattern(config, layers),
        moe_shared_expert_ffn_hidden_size=int(config["moe_intermediate_size"])
        * int(config.get("n_shared_experts") or 0),
        moe_router_num_groups=groups if groups > 1 else 0,
        moe_router_group_topk=int(config.get("topk_group") or 1) if groups > 1 else 0,
    )


def layer_params(arch, moe: bool, tp: int = 1, ep: int = 1, etp: int = 1) -> int:
    """One decoder layer's parameters on one rank (tp/ep/etp 1: the whole layer)."""
    h = arch.hidden_size
    attn = arch.mla.attention_params(h, arch.num_attention_heads) // tp
    if moe:
        experts = math.ceil(arch.num_experts / ep)
        mlp = experts * 3 * h * arch.moe_ffn_hidden_size // etp + arch.num_experts * (h + 1)
        mlp += 3 * h * arch.moe_shared_expert_ffn_hidden_size // tp
    else:
        mlp = 3 * h * arch.ffn_hidden_size // tp
    return attn + mlp + 2 * h


def num_parameters(arch) -> int:
    """Parameter count of the HF model without its multi-token-prediction modules."""
    layers = sum(layer_params(arch, bool(moe)) for moe in arch.moe_layer_pattern)
    embed = arch.vocab_size * arch.hidden_size
    return layers + embed + (0 if arch.tie_word_embeddings else embed) + arch.hidden_size


def stage_layer_params(arch, tp: int, pp: int, ep: int, etp: int, stage: int) -> int:
    """The decoder layers' parameters held by one rank of pipeline stage `stage` (Megatron's even split)."""
    per_stage = math.ceil(arch.num_layers / pp)
    pattern = arch.moe_layer_pattern[stage * per_stage : (stage + 1) * per_stage]
    return sum(layer_params(arch, bool(moe), tp, ep, etp) for moe in pattern)


def parallel_checks(arch, tp: int) -> list[tuple[str, int, int, str]]:
    """(name, value, size, flag) rows validate_parallel adds: the dense layers' FFN, the shared expert, and the
    latent widths that the local spec's down projections split over TP."""
    flag = "--tensor-model-parallel-size"
    rows = [("intermediate_size", arch.ffn_hidden_size, tp, flag)]
    if arch.moe_shared_expert_ffn_hidden_size:
        rows.append(("moe_intermediate_size x n_shared_experts", arch.moe_shared_expert_ffn_hidden_size, tp, flag))
    if arch.mla.q_lora_rank:
        rows.append(("q_lora_rank", arch.mla.q_lora_rank, tp, flag))
    rows.append(("kv_lora_rank + qk_rope_head_dim", arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim, tp, flag))
    return rows
