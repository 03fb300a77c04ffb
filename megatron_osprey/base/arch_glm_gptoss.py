"""The config.json facts of two more mixture-of-experts families, as ModelArch fields (torch-free).

GLM-4.5 (`glm4_moe`): partial RoPE, q/k/v biases, optional per-head q/k norm, a shared expert beside the routed
ones, sigmoid routing with a score-correction bias, optionally group-limited, with a routed scaling factor, and
its first `first_k_dense_replace` layers dense. Its multi-token-prediction layers (`num_nextn_predict_layers`,
stored as model.layers.{num_hidden_layers}...) are not part of the target's forward: they are counted here and
never read.

gpt-oss (`gpt_oss`): a learned attention sink per head, sliding-window layers alternating with full ones, biases
on every linear layer, YaRN RoPE, and experts whose SwiGLU is clamped (gate at most `swiglu_limit`, up within
+-limit) with an `(up + 1)` term and a sigmoid slope of 1.702; the router softmaxes its top-k logits.
"""

from __future__ import annotations

import math
from typing import Any

from megatron_osprey.base.dense_families import FULL, SLIDING

# The sigmoid slope Megatron-Core's quick_gelu hard-codes; gpt-oss's swiglu_alpha must equal it.
QUICK_GELU_ALPHA = 1.702
YARN_FAMILIES = ("gpt_oss",)


def glm4_moe_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    """ModelArch fields of a GLM-4.5 config.json."""
    experts = int(config["n_routed_experts"])
    groups = int(config.get("n_group") or 1)
    group_topk = int(config.get("topk_group") or 1)
    topk = int(config["num_experts_per_tok"])
    if experts % groups or group_topk > groups:
        raise ValueError(
            f"{source}: n_group {groups} must divide n_routed_experts {experts} and be at least topk_group "
            f"{group_topk}."
        )
    if groups > 1 and topk != 2 * group_topk:
        # HF scores a group by its top-2 experts; Megatron-Core by its top (topk / topk_group).
        raise ValueError(
            f"{source}: group-limited routing with num_experts_per_tok {topk} and topk_group {group_topk} is not "
            f"supported: a group is scored by its top 2 experts, which Megatron-Core reproduces only when "
            f"num_experts_per_tok = 2 x topk_group."
        )
    if not config.get("norm_topk_prob", True) and topk > 1:
        raise ValueError(
            f"{source}: norm_topk_prob false is not supported: Megatron-Core's sigmoid router always renormalizes "
            f"the top-k scores."
        )
    scaling = float(config.get("routed_scaling_factor") or 1.0)
    shared = int(config.get("n_shared_experts") or 0)
    layers = int(config["num_hidden_layers"])
    dense = min(int(config.get("first_k_dense_replace") or 0), layers)
    return dict(
        num_experts=experts,
        moe_ffn_hidden_size=int(config["moe_intermediate_size"]),
        moe_router_topk=topk,
        moe_score_function="sigmoid",
        moe_norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        moe_expert_bias=True,  # e_score_correction_bias: HF always has the buffer (zeros when untrained)
        moe_topk_scaling_factor=None if scaling == 1.0 else scaling,
        moe_shared_expert_ffn_hidden_size=shared * int(config["moe_intermediate_size"]),
        moe_layer_pattern=(0,) * dense + (1,) * (layers - dense),
        moe_router_num_groups=groups if groups > 1 else 0,
        moe_router_group_topk=group_topk if groups > 1 else 0,
        mtp_layers=int(config.get("num_nextn_predict_layers") or 0),
    )


def gpt_oss_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    """ModelArch fields of a gpt-oss config.json."""
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
    if len(types) < layers:
        raise ValueError(f"{source}: layer_types lists {len(types)} layers, num_hidden_layers is {layers}.")
    window = int(config.get("sliding_window") or 0)
    sliding = tuple(i for i, kind in enumerate(types[:layers]) if kind == SLIDING)
    if sliding and not window:
        raise ValueError(f"{source}: layer_types has sliding_attention layers but sliding_window is not set.")
    return dict(
        num_experts=int(config["num_local_experts"]),
        # Each expert is as wide as intermediate_size; there is no dense MLP.
        moe_ffn_hidden_size=int(config["intermediate_size"]),
        moe_router_topk=int(config["num_experts_per_tok"]),
        moe_score_function="softmax",
        moe_norm_topk_prob=True,  # softmax over the top-k logits
        linear_bias=True,
        attention_sinks=True,
        sliding_window=window if sliding else 0,
        layer_types=tuple(types[:layers]),
        activation="clamped_swiglu",
        swiglu_limit=float(config.get("swiglu_limit", 7.0)),
    )


FAMILY_FIELDS = {"glm4_moe": glm4_moe_fields, "gpt_oss": gpt_oss_fields}


def yarn_scaling(rope: dict[str, Any], max_position_embeddings: int, source: str) -> dict[str, Any]:
    """The YaRN parameters HF reads (transformers' _compute_yarn_parameters), with its defaults filled in."""
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if rope.get(key) is not None:
            raise ValueError(f"{source}: YaRN rope {key} is not supported (gpt-oss's YaRN has none).")
    original = rope.get("original_max_position_embeddings")
    if not isinstance(original, (int, float)) or isinstance(original, bool) or original <= 0:
        raise ValueError(f"{source}: YaRN rope needs original_max_position_embeddings, a positive number.")
    factor = rope.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / float(original)
    return {
        "rope_type": "yarn",
        "factor": factor,
        "beta_fast": float(rope.get("beta_fast") or 32),
        "beta_slow": float(rope.get("beta_slow") or 1),
        "original_max_position_embeddings": int(original),
        "truncate": bool(rope.get("truncate", True)),
    }


def yarn_attention_factor(scaling: dict[str, Any] | None) -> float:
    """YaRN's cos/sin multiplier (0.1 ln(factor) + 1); q.k scales by its square. 1 without YaRN."""
    if not scaling or scaling.get("rope_type") != "yarn" or scaling["factor"] <= 1:
        return 1.0
    return 0.1 * math.log(scaling["factor"]) + 1.0
