"""Declarative HF <-> Megatron-Core name maps: Qwen3 / Llama / Qwen2 / Mistral dense, Gemma 3, Qwen3-MoE, MiniMax-M2.

Each rule names one Megatron parameter, the HF tensor(s) it is made of, and how
it is split across tensor-parallel ranks. The two special cases are the fused
QKV (interleaved per query group) and the fused gate/up of SwiGLU; everything
else is a plain copy or a split along one dimension. Expert rules carry an
`{expert}` index: the Megatron name holds the rank-local expert, the HF name the
global one (local + ep_rank x experts per rank), and their TP split is over the
expert-tensor-parallel group.
"""

from __future__ import annotations

import dataclasses
import enum
import re

from megatron_osprey.base.arch import ModelArch


class Split(enum.Enum):
    REPLICATED = "replicated"  # norms: every TP rank holds the whole tensor
    COLUMN = "column"  # split along dim 0 (ColumnParallelLinear)
    ROW = "row"  # split along dim 1 (RowParallelLinear)
    VOCAB = "vocab"  # dim 0, padded to Megatron's padded vocab size
    QKV = "qkv"  # q, k, v interleaved per query group, split by groups
    GATE_UP = "gate_up"  # gate and up each split, then concatenated per rank
    # One expert's slice of a tensor that holds every expert (gpt-oss, maybe MXFP4: convert/mxfp4.py).
    EXPERT_GATE_UP_INTERLEAVED = "expert_gate_up_interleaved"  # [in, 2 x out] with gate, up alternating columns
    EXPERT_DOWN = "expert_down"  # [in, out]: transposed, then split like ROW
    EXPERT_REPLICATED = "expert_replicated"  # [out] (the down-projection bias)
    # Multi-latent attention (convert/deepseek_v3.py): the rope rows de-interleaved, then split.
    MLA_Q = "mla_q"  # per head [nope | rope] rows, split by heads
    MLA_KV_DOWN = "mla_kv_down"  # [kv latent | rope] rows, split along dim 0
    MLA_KV_DOWN_FULL = "mla_kv_down_full"  # the same, whole on every rank (TE's duplicated down projection)


@dataclasses.dataclass(frozen=True)
class WeightRule:
    megatron: str  # may contain {layer}
    hf: tuple[str, ...]  # may contain {layer}
    split: Split
    when: str | None = None  # a boolean ModelArch attribute that must be true
    families: tuple[str, ...] | None = None  # None: every family
    expert: bool = False  # one per routed expert; name templates carry {expert}
    buffer: bool = False  # a module buffer (router expert bias), not a parameter

    def applies(self, arch: ModelArch) -> bool:
        if self.families is not None and arch.family not in self.families:
            return False
        return self.when is None or bool(getattr(arch, self.when))

    def pattern(self) -> re.Pattern:
        escaped = re.escape(self.megatron)
        escaped = escaped.replace(r"\{layer\}", r"(?P<layer>\d+)").replace(r"\{expert\}", r"(?P<expert>\d+)")
        return re.compile("^" + escaped + "$")


_ATTN = "model.layers.{layer}.self_attn"
_MLP = "model.layers.{layer}.mlp"
_LAYER = "decoder.layers.{layer}"

DENSE_RULES: tuple[WeightRule, ...] = (
    WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Split.VOCAB),
    WeightRule(f"{_LAYER}.input_layernorm.weight", ("model.layers.{layer}.input_layernorm.weight",), Split.REPLICATED),
    WeightRule(
        f"{_LAYER}.self_attention.linear_qkv.weight",
        (f"{_ATTN}.q_proj.weight", f"{_ATTN}.k_proj.weight", f"{_ATTN}.v_proj.weight"),
        Split.QKV,
    ),
    WeightRule(
        f"{_LAYER}.self_attention.linear_qkv.bias",
        (f"{_ATTN}.q_proj.bias", f"{_ATTN}.k_proj.bias", f"{_ATTN}.v_proj.bias"),
        Split.QKV,
        when="qkv_bias",
    ),
    WeightRule(
        f"{_LAYER}.self_attention.q_layernorm.weight",
        (f"{_ATTN}.q_norm.weight",),
        Split.REPLICATED,
        when="qk_layernorm",
    ),
    WeightRule(
        f"{_LAYER}.self_attention.k_layernorm.weight",
        (f"{_ATTN}.k_norm.weight",),
        Split.REPLICATED,
        when="qk_layernorm",
    ),
    WeightRule(f"{_LAYER}.self_attention.linear_proj.weight", (f"{_ATTN}.o_proj.weight",), Split.ROW),
    WeightRule(
        f"{_LAYER}.pre_mlp_layernorm.weight",
        ("model.layers.{layer}.post_attention_layernorm.weight",),
        Split.REPLICATED,
    ),
    WeightRule(
        f"{_LAYER}.mlp.linear_fc1.weight",
        (f"{_MLP}.gate_proj.weight", f"{_MLP}.up_proj.weight"),
        Split.GATE_UP,
        when="is_dense",
    ),
    WeightRule(f"{_LAYER}.mlp.linear_fc2.weight", (f"{_MLP}.down_proj.weight",), Split.ROW, when="is_dense"),
    WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",), Split.REPLICATED),
    WeightRule("output_layer.weight", ("lm_head.weight",), Split.VOCAB),
)

_EXPERT = f"{_LAYER}.mlp.experts.local_experts.{{expert}}"
_QWEN3_MOE = ("qwen3_moe",)
_MINIMAX = ("minimax_m2",)
_MOE_BLOCK = "model.layers.{layer}.block_sparse_moe"


def _expert_mlp(hf_expert: str, gate: str, up: str, down: str, families: tuple[str, ...]) -> tuple[WeightRule, ...]:
    """One routed expert's gated MLP: HF `gate` and `up` fuse into fc1, `down` is fc2."""
    return (
        WeightRule(
            f"{_EXPERT}.linear_fc1.weight",
            (f"{hf_expert}.{gate}.weight", f"{hf_expert}.{up}.weight"),
            Split.GATE_UP,
            families=families,
            expert=True,
        ),
        WeightRule(
            f"{_EXPERT}.linear_fc2.weight", (f"{hf_expert}.{down}.weight",), Split.ROW, families=families, expert=True
        ),
    )


MOE_RULES: tuple[WeightRule, ...] = (
    # Qwen3-MoE: softmax router, experts as gate/up/down projections.
    WeightRule(f"{_LAYER}.mlp.router.weight", (f"{_MLP}.gate.weight",), Split.REPLICATED, families=_QWEN3_MOE),
    *_expert_mlp(f"{_MLP}.experts.{{expert}}", "gate_proj", "up_proj", "down_proj", _QWEN3_MOE),
    # MiniMax-M2: Mixtral-style names (w1 gate, w3 up, w2 down), sigmoid router with a routing bias.
    WeightRule(f"{_LAYER}.mlp.router.weight", (f"{_MOE_BLOCK}.gate.weight",), Split.REPLICATED, families=_MINIMAX),
    WeightRule(
        f"{_LAYER}.mlp.router.expert_bias",
        (f"{_MOE_BLOCK}.e_score_correction_bias",),
        Split.REPLICATED,
        families=_MINIMAX,
        when="moe_expert_bias",
        buffer=True,
    ),
    *_expert_mlp(f"{_MOE_BLOCK}.experts.{{expert}}", "w1", "w3", "w2", _MINIMAX),
)

_GLM = ("glm4_moe",)
_GPTOSS = ("gpt_oss",)
_GPTOSS_EXPERTS = f"{_MLP}.experts"

GLM_GPTOSS_RULES: tuple[WeightRule, ...] = (
    # GLM-4.5: dense MLPs in the first layers, then a sigmoid router with a routing bias, routed and shared experts.
    WeightRule(
        f"{_LAYER}.mlp.linear_fc1.weight",
        (f"{_MLP}.gate_proj.weight", f"{_MLP}.up_proj.weight"),
        Split.GATE_UP,
        families=_GLM,
        when="dense_layer_count",
    ),
    WeightRule(
        f"{_LAYER}.mlp.linear_fc2.weight",
        (f"{_MLP}.down_proj.weight",),
        Split.ROW,
        families=_GLM,
        when="dense_layer_count",
    ),
    WeightRule(f"{_LAYER}.mlp.router.weight", (f"{_MLP}.gate.weight",), Split.REPLICATED, families=_GLM),
    WeightRule(
        f"{_LAYER}.mlp.router.expert_bias",
        (f"{_MLP}.gate.e_score_correction_bias",),
        Split.REPLICATED,
        families=_GLM,
        buffer=True,
    ),
    *_expert_mlp(f"{_MLP}.experts.{{expert}}", "gate_proj", "up_proj", "down_proj", _GLM),
    WeightRule(
        f"{_LAYER}.mlp.shared_experts.linear_fc1.weight",
        (f"{_MLP}.shared_experts.gate_proj.weight", f"{_MLP}.shared_experts.up_proj.weight"),
        Split.GATE_UP,
        families=_GLM,
        when="moe_shared_expert_ffn_hidden_size",
    ),
    WeightRule(
        f"{_LAYER}.mlp.shared_experts.linear_fc2.weight",
        (f"{_MLP}.shared_experts.down_proj.weight",),
        Split.ROW,
        families=_GLM,
        when="moe_shared_expert_ffn_hidden_size",
    ),
    # gpt-oss: o_proj bias, a sink logit per head, a router with a bias, experts fused over the expert axis.
    WeightRule(
        f"{_LAYER}.self_attention.linear_proj.bias", (f"{_ATTN}.o_proj.bias",), Split.REPLICATED, when="linear_bias"
    ),
    WeightRule(
        f"{_LAYER}.self_attention.core_attention.softmax_offset",
        (f"{_ATTN}.sinks",),
        Split.COLUMN,
        when="attention_sinks",
    ),
    WeightRule(f"{_LAYER}.mlp.router.weight", (f"{_MLP}.router.weight",), Split.REPLICATED, families=_GPTOSS),
    WeightRule(f"{_LAYER}.mlp.router.bias", (f"{_MLP}.router.bias",), Split.REPLICATED, families=_GPTOSS),
    WeightRule(
        f"{_EXPERT}.linear_fc1.weight",
        (f"{_GPTOSS_EXPERTS}.gate_up_proj",),
        Split.EXPERT_GATE_UP_INTERLEAVED,
        families=_GPTOSS,
        expert=True,
    ),
    WeightRule(
        f"{_EXPERT}.linear_fc1.bias",
        (f"{_GPTOSS_EXPERTS}.gate_up_proj_bias",),
        Split.EXPERT_GATE_UP_INTERLEAVED,
        families=_GPTOSS,
        expert=True,
    ),
    WeightRule(
        f"{_EXPERT}.linear_fc2.weight",
        (f"{_GPTOSS_EXPERTS}.down_proj",),
        Split.EXPERT_DOWN,
        families=_GPTOSS,
        expert=True,
    ),
    WeightRule(
        f"{_EXPERT}.linear_fc2.bias",
        (f"{_GPTOSS_EXPERTS}.down_proj_bias",),
        Split.EXPERT_REPLICATED,
        families=_GPTOSS,
        expert=True,
    ),
)

_GEMMA3 = ("gemma3_text", "gemma3")

# Gemma 3's sandwich norms: its norm before the MLP is pre_feedforward_layernorm, and its post_attention_layernorm
# normalizes the attention output (on linear_proj, models/backbone/dense_variants.py), as post_feedforward_layernorm
# does the MLP's. A family rule replaces the DENSE_RULES rule of the same Megatron name.
GEMMA3_RULES: tuple[WeightRule, ...] = (
    WeightRule(
        f"{_LAYER}.pre_mlp_layernorm.weight",
        ("model.layers.{layer}.pre_feedforward_layernorm.weight",),
        Split.REPLICATED,
        families=_GEMMA3,
    ),
    WeightRule(
        f"{_LAYER}.self_attention.linear_proj.post_norm.weight",
        ("model.layers.{layer}.post_attention_layernorm.weight",),
        Split.REPLICATED,
        families=_GEMMA3,
    ),
    WeightRule(
        f"{_LAYER}.mlp.linear_fc2.post_norm.weight",
        ("model.layers.{layer}.post_feedforward_layernorm.weight",),
        Split.REPLICATED,
        families=_GEMMA3,
    ),
)

# Where a family's checkpoint keeps the language model under a prefix: the multimodal Gemma 3
# (Gemma3ForConditionalGeneration) stores language_model.model.layers..., as published and as transformers saves it.
HF_NAME_PREFIX: dict[str, str] = {"gemma3": "language_model."}


def hf_checkpoint_name(arch: ModelArch, name: str) -> str:
    """The name under which `arch`'s checkpoint stores the HF tensor `name` (model.* / lm_head.*)."""
    return HF_NAME_PREFIX.get(arch.family, "") + name


# The Transformer Engine spec fuses the pre-attention and pre-MLP norms into the
# following linear layers: same tensors, other names.
TE_RENAMES: dict[str, str] = {
    f"{_LAYER}.input_layernorm.weight": f"{_LAYER}.self_attention.linear_qkv.layer_norm_weight",
    f"{_LAYER}.pre_mlp_layernorm.weight": f"{_LAYER}.mlp.linear_fc1.layer_norm_weight",
}


# TE's grouped-GEMM experts keep one weight per local expert on a single module.
TE_EXPERT_RENAMES: dict[str, str] = {
    f"{_EXPERT}.linear_fc1.weight": f"{_LAYER}.mlp.experts.linear_fc1.weight{{expert}}",
    f"{_EXPERT}.linear_fc2.weight": f"{_LAYER}.mlp.experts.linear_fc2.weight{{expert}}",
    f"{_EXPERT}.linear_fc1.bias": f"{_LAYER}.mlp.experts.linear_fc1.bias{{expert}}",
    f"{_EXPERT}.linear_fc2.bias": f"{_LAYER}.mlp.experts.linear_fc2.bias{{expert}}",
}
_QK_NORMS = (f"{_LAYER}.self_attention.q_layernorm.weight", f"{_LAYER}.self_attention.k_layernorm.weight")


def rules_for(arch: ModelArch, transformer_impl: str = "local") -> list[WeightRule]:
    """The rules that apply to `arch`, with the spec's parameter names."""
    if arch.mla is not None:
        raise ValueError(f"{arch.family}: multi-latent attention has its own rules (convert/deepseek_v3.py).")
    rules = []
    te = transformer_impl == "transformer_engine"
    family_rules = [rule for rule in GEMMA3_RULES if rule.applies(arch)]
    replaced = {rule.megatron for rule in family_rules}
    for rule in family_rules + [r for r in DENSE_RULES + MOE_RULES + GLM_GPTOSS_RULES if r.megatron not in replaced]:
        if not rule.applies(arch):
            continue
        if rule.megatron in _QK_NORMS and arch.qk_norm_over_projection:
            # One weight per channel of the whole projection: split by heads like q / k rows.
            rule = dataclasses.replace(rule, split=Split.COLUMN)
        # MoE layers keep a standalone pre-MLP norm in the TE spec (no fused fc1 to hold it).
        fused_norm = rule.megatron in TE_RENAMES and not (arch.is_moe and "pre_mlp" in rule.megatron)
        if te and arch.dense_layer_count and rule.megatron in TE_RENAMES and "pre_mlp" in rule.megatron:
            # A dense-then-MoE stack (GLM-4.5): dense layers fuse the norm into fc1, MoE layers keep it.
            rules.append(dataclasses.replace(rule, megatron=TE_RENAMES[rule.megatron]))
        if te and fused_norm:
            rule = dataclasses.replace(rule, megatron=TE_RENAMES[rule.megatron])
        if te and rule.megatron in TE_EXPERT_RENAMES:
            rule = dataclasses.replace(rule, megatron=TE_EXPERT_RENAMES[rule.megatron])
        rules.append(rule)
    return rules


def match_rule_indices(name: str, rules: list[WeightRule]) -> tuple[WeightRule, dict[str, int]] | None:
    """Find the rule for a Megatron name; returns (rule, {"layer": i, "expert": j} as present)."""
    for rule in rules:
        found = rule.pattern().match(name)
        if found:
            return rule, {k: int(v) for k, v in found.groupdict().items()}
    return None


def match_rule(name: str, rules: list[WeightRule]) -> tuple[WeightRule, int | None] | None:
    """Find the rule for a Megatron parameter name; returns (rule, local layer index)."""
    found = match_rule_indices(name, rules)
    if found is None:
        return None
    rule, indices = found
    return rule, indices.get("layer")
