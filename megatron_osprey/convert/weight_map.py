"""Declarative HF <-> Megatron-Core name maps for Qwen3 and Llama dense models.

Each rule names one Megatron parameter, the HF tensor(s) it is made of, and how
it is split across tensor-parallel ranks. The two special cases are the fused
QKV (interleaved per query group) and the fused gate/up of SwiGLU; everything
else is a plain copy or a split along one dimension.
"""

from __future__ import annotations

import dataclasses
import enum
import re

from megatron_osprey.models.arch import ModelArch


class Split(enum.Enum):
    REPLICATED = "replicated"  # norms: every TP rank holds the whole tensor
    COLUMN = "column"  # split along dim 0 (ColumnParallelLinear)
    ROW = "row"  # split along dim 1 (RowParallelLinear)
    VOCAB = "vocab"  # dim 0, padded to Megatron's padded vocab size
    QKV = "qkv"  # q, k, v interleaved per query group, split by groups
    GATE_UP = "gate_up"  # gate and up each split, then concatenated per rank


@dataclasses.dataclass(frozen=True)
class WeightRule:
    megatron: str  # may contain {layer}
    hf: tuple[str, ...]  # may contain {layer}
    split: Split
    when: str | None = None  # a boolean ModelArch attribute that must be true

    def applies(self, arch: ModelArch) -> bool:
        return self.when is None or bool(getattr(arch, self.when))

    def pattern(self) -> re.Pattern:
        return re.compile("^" + re.escape(self.megatron).replace(r"\{layer\}", r"(\d+)") + "$")


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
    WeightRule(f"{_LAYER}.self_attention.q_layernorm.weight", (f"{_ATTN}.q_norm.weight",), Split.REPLICATED, when="qk_layernorm"),
    WeightRule(f"{_LAYER}.self_attention.k_layernorm.weight", (f"{_ATTN}.k_norm.weight",), Split.REPLICATED, when="qk_layernorm"),
    WeightRule(f"{_LAYER}.self_attention.linear_proj.weight", (f"{_ATTN}.o_proj.weight",), Split.ROW),
    WeightRule(f"{_LAYER}.pre_mlp_layernorm.weight", ("model.layers.{layer}.post_attention_layernorm.weight",), Split.REPLICATED),
    WeightRule(f"{_LAYER}.mlp.linear_fc1.weight", (f"{_MLP}.gate_proj.weight", f"{_MLP}.up_proj.weight"), Split.GATE_UP),
    WeightRule(f"{_LAYER}.mlp.linear_fc2.weight", (f"{_MLP}.down_proj.weight",), Split.ROW),
    WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",), Split.REPLICATED),
    WeightRule("output_layer.weight", ("lm_head.weight",), Split.VOCAB),
)

# The Transformer Engine spec fuses the pre-attention and pre-MLP norms into the
# following linear layers: same tensors, other names.
TE_RENAMES: dict[str, str] = {
    f"{_LAYER}.input_layernorm.weight": f"{_LAYER}.self_attention.linear_qkv.layer_norm_weight",
    f"{_LAYER}.pre_mlp_layernorm.weight": f"{_LAYER}.mlp.linear_fc1.layer_norm_weight",
}


def rules_for(arch: ModelArch, transformer_impl: str = "local") -> list[WeightRule]:
    """The rules that apply to `arch`, with the spec's parameter names."""
    rules = []
    for rule in DENSE_RULES:
        if not rule.applies(arch):
            continue
        if transformer_impl == "transformer_engine" and rule.megatron in TE_RENAMES:
            rule = dataclasses.replace(rule, megatron=TE_RENAMES[rule.megatron])
        rules.append(rule)
    return rules


def match_rule(name: str, rules: list[WeightRule]) -> tuple[WeightRule, int | None] | None:
    """Find the rule for a Megatron parameter name; returns (rule, local layer index)."""
    for rule in rules:
        found = rule.pattern().match(name)
        if found:
            return rule, (int(found.group(1)) if found.groups() else None)
    return None
