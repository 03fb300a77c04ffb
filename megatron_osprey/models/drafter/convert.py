"""Exact weight conversion between the Megatron drafter and the plain-PyTorch reference drafter.

The same declarative rules as the HF <-> Megatron maps (convert/weight_map.py),
with the reference drafter's names. One wrinkle: Megatron always calls the
norm on the stream `input_layernorm` and the norm on the side input
`hidden_norm`; the reference names them by role per variant (for EAGLE-3's first
layer the side input is the embedding, normed by `input_layernorm`).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_osprey.convert.sharding import merge_shards, read_shard
from megatron_osprey.convert.weight_map import Split, WeightRule, match_rule
from megatron_osprey.models.drafter.arch import DrafterArch

_L = "decoder.layers.{layer}"
_R = "layers.{layer}"


def drafter_rules(arch: DrafterArch, layer_fused: list[bool]) -> list[WeightRule]:
    """Megatron drafter parameter -> reference tensors, per layer kind."""
    qk = arch.body.qk_layernorm
    rules = [
        WeightRule("embedding.word_embeddings.weight", ("embed_tokens.weight",), Split.VOCAB),
        WeightRule("fusion_fc.weight", ("fc.weight",), Split.REPLICATED),
        WeightRule("final_layernorm.weight", ("norm.weight",), Split.REPLICATED),
        WeightRule("output_layer.weight", ("lm_head.weight",), Split.VOCAB),
    ]
    if arch.aux_hidden_norm:
        rules += [WeightRule(f"aux_norms.{i}.weight", (f"fc_norm.{i}.weight",), Split.REPLICATED) for i in range(3)]
    for index, fused in enumerate(layer_fused):
        eagle_first = fused and arch.variant == "eagle3"
        stream_norm = "hidden_norm" if eagle_first else "input_layernorm"
        side_norm = "input_layernorm" if eagle_first else "hidden_norm"
        layer_rules = [
            (f"{_L}.input_layernorm.weight", (f"{_R}.{stream_norm}.weight",), Split.REPLICATED),
            (
                f"{_L}.self_attention.linear_qkv.weight",
                tuple(f"{_R}.self_attn.{p}_proj.weight" for p in "qkv"),
                Split.QKV,
            ),
            (f"{_L}.self_attention.linear_proj.weight", (f"{_R}.self_attn.o_proj.weight",), Split.ROW),
            (f"{_L}.pre_mlp_layernorm.weight", (f"{_R}.post_attention_layernorm.weight",), Split.REPLICATED),
            (f"{_L}.mlp.linear_fc1.weight", (f"{_R}.mlp.gate_proj.weight", f"{_R}.mlp.up_proj.weight"), Split.GATE_UP),
            (f"{_L}.mlp.linear_fc2.weight", (f"{_R}.mlp.down_proj.weight",), Split.ROW),
        ]
        if fused:
            layer_rules.append(
                (f"{_L}.self_attention.hidden_norm.weight", (f"{_R}.{side_norm}.weight",), Split.REPLICATED)
            )
        if qk:
            layer_rules += [
                (f"{_L}.self_attention.q_layernorm.weight", (f"{_R}.self_attn.q_norm.weight",), Split.REPLICATED),
                (f"{_L}.self_attention.k_layernorm.weight", (f"{_R}.self_attn.k_norm.weight",), Split.REPLICATED),
            ]
        for megatron, hf, split in layer_rules:
            rules.append(
                WeightRule(
                    megatron.replace("{layer}", str(index)),
                    tuple(name.replace("{layer}", str(index)) for name in hf),
                    split,
                )
            )
    return rules


class TensorDictSource:
    """The slice-reading interface of SafetensorsCheckpoint over an in-memory state dict."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> list[int]:
        return list(self.tensors[name].shape)

    def read(self, name, rows=None, cols=None) -> torch.Tensor:
        tensor = self.tensors[name]
        if rows is not None:
            tensor = tensor[rows[0] : rows[1]]
        if cols is not None:
            tensor = tensor[:, cols[0] : cols[1]]
        return tensor.clone()


def _vocab_arch(arch: DrafterArch, name: str):
    # VOCAB splits pad to Megatron's padded size of *that* table's vocabulary.
    size = arch.draft_vocab_size if name == "output_layer.weight" else arch.vocab_size
    return dataclasses.replace(arch.body, vocab_size=size)


def _layer_fused(model) -> list[bool]:
    return [hasattr(layer.self_attention, "hidden_norm") for layer in model.decoder.layers]


@torch.no_grad()
def load_reference_state(model, state: dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> None:
    """Copy a reference drafter state dict into this TP rank's Megatron drafter."""
    arch: DrafterArch = model.arch
    rules = drafter_rules(arch, _layer_fused(model))
    source = TensorDictSource(state)
    for name, param in model.named_parameters():
        found = match_rule(name, rules)
        if found is None:
            raise KeyError(f"no reference-drafter rule for Megatron parameter {name!r}.")
        rule = found[0]
        shard = read_shard(source, rule, list(rule.hf), _vocab_arch(arch, name), tp_rank, tp_size)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(f"{rule.hf} gives shape {tuple(shard.shape)} for {name} of shape {tuple(param.shape)}.")
        param.copy_(shard.to(param.dtype))
    model.d2t.copy_(state["d2t"])
    model.t2d.copy_(state["t2d"])


@torch.no_grad()
def reference_state(model, tp_group=None) -> dict[str, torch.Tensor]:
    """The reference drafter's state dict from a (TP-sharded) Megatron drafter; collective over TP."""
    from megatron_osprey.convert.megatron_to_hf import _gather_tp

    arch: DrafterArch = model.arch
    rules = drafter_rules(arch, _layer_fused(model))
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        found = match_rule(name, rules)
        if found is None:
            raise KeyError(f"no reference-drafter rule for Megatron parameter {name!r}.")
        rule = found[0]
        shards = [param.detach()] if rule.split is Split.REPLICATED else _gather_tp(param.detach(), tp_group)
        out.update(
            {k: v.clone() for k, v in merge_shards(rule, shards, list(rule.hf), _vocab_arch(arch, name)).items()}
        )
    out["d2t"] = model.d2t.detach().clone()
    out["t2d"] = model.t2d.detach().clone()
    return out
