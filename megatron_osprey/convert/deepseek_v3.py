"""HF -> Megatron-Core weight rules for DeepSeek-V3 / Kimi-K2 (multi-latent attention, shared and routed experts).

The checkpoint's names are the release's (transformers writes the same): model.layers.{i}.self_attn.{q_a_proj,
q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}, mlp.{gate_proj, up_proj,
down_proj} in the first_k_dense_replace dense layers, and mlp.{gate.weight, gate.e_score_correction_bias,
experts.{e}.*, shared_experts.*} in the others. FP8 block-scaled tensors are dequantized as they are read
(convert/safetensors_io.py), as for MiniMax-M2.

The rope rows: the release stores each head's rope channels as interleaved pairs (rope_interleave, transformers'
default for this family) and Megatron-Core's MLA de-interleaves them itself before rotating halves, so they are
read as stored. A checkpoint with rope_interleave false stores halves: its rope rows of q_b_proj (per head) and
kv_a_proj_with_mqa are read interleaved, [0, d/2, 1, d/2 + 1, ...], which Megatron-Core's de-interleave turns back
into the halves; q and k are reordered alike.

Not read, by design: the multi-token-prediction modules (num_nextn_predict_layers of them, stored as
model.layers.{L + k}.* after the L decoder layers: enorm, hnorm, eh_proj, shared_head and a full layer), which the
target's forward never runs; `mtp_weight_names` lists them.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.convert.weight_map import TE_EXPERT_RENAMES, Split, WeightRule

_LAYER = "decoder.layers.{layer}"
_ATTN = "model.layers.{layer}.self_attn"
_MLP = "model.layers.{layer}.mlp"
_SELF = f"{_LAYER}.self_attention"
_EXPERT = f"{_LAYER}.mlp.experts.local_experts.{{expert}}"


def _gated(megatron: str, hf: str, **kw) -> tuple[WeightRule, WeightRule]:
    """A SwiGLU MLP: HF gate_proj + up_proj -> linear_fc1, down_proj -> linear_fc2."""
    return (
        WeightRule(
            f"{megatron}.linear_fc1.weight", (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"), Split.GATE_UP, **kw
        ),
        WeightRule(f"{megatron}.linear_fc2.weight", (f"{hf}.down_proj.weight",), Split.ROW, **kw),
    )


def deepseek_v3_rules(arch: ModelArch, transformer_impl: str = "local") -> list[WeightRule]:
    """The rules of `arch`'s parameters, with the local or Transformer Engine spec's names."""
    te = transformer_impl == "transformer_engine"
    # TE fuses the latent norms into the up projections and keeps the down projections whole on every rank.
    q_norm = f"{_SELF}.linear_q_up_proj.layer_norm_weight" if te else f"{_SELF}.q_layernorm.weight"
    kv_norm = f"{_SELF}.linear_kv_up_proj.layer_norm_weight" if te else f"{_SELF}.kv_layernorm.weight"
    rules = [
        WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Split.VOCAB),
        WeightRule(
            f"{_LAYER}.input_layernorm.weight", ("model.layers.{layer}.input_layernorm.weight",), Split.REPLICATED
        ),
        WeightRule(
            f"{_SELF}.linear_kv_down_proj.weight",
            (f"{_ATTN}.kv_a_proj_with_mqa.weight",),
            Split.MLA_KV_DOWN_FULL if te else Split.MLA_KV_DOWN,
        ),
        WeightRule(kv_norm, (f"{_ATTN}.kv_a_layernorm.weight",), Split.REPLICATED),
        WeightRule(f"{_SELF}.linear_kv_up_proj.weight", (f"{_ATTN}.kv_b_proj.weight",), Split.COLUMN),
        WeightRule(f"{_SELF}.linear_proj.weight", (f"{_ATTN}.o_proj.weight",), Split.ROW),
        # Dense layers' pre-MLP norm (TE fuses it into fc1) and MoE layers' (standalone in both specs).
        WeightRule(
            f"{_LAYER}.mlp.linear_fc1.layer_norm_weight" if te else f"{_LAYER}.pre_mlp_layernorm.weight",
            ("model.layers.{layer}.post_attention_layernorm.weight",),
            Split.REPLICATED,
        ),
        *_gated(f"{_LAYER}.mlp", _MLP),
        WeightRule(f"{_LAYER}.mlp.router.weight", (f"{_MLP}.gate.weight",), Split.REPLICATED),
        WeightRule(
            f"{_LAYER}.mlp.router.expert_bias", (f"{_MLP}.gate.e_score_correction_bias",), Split.REPLICATED, buffer=True
        ),
        *_gated(_EXPERT, f"{_MLP}.experts.{{expert}}", expert=True),
        *_gated(f"{_LAYER}.mlp.shared_experts", f"{_MLP}.shared_experts"),
        WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",), Split.REPLICATED),
        WeightRule("output_layer.weight", ("lm_head.weight",), Split.VOCAB),
    ]
    if te:
        rules.append(
            WeightRule(
                f"{_LAYER}.pre_mlp_layernorm.weight",
                ("model.layers.{layer}.post_attention_layernorm.weight",),
                Split.REPLICATED,
            )
        )
        rules = [
            dataclasses.replace(r, megatron=TE_EXPERT_RENAMES[r.megatron]) if r.megatron in TE_EXPERT_RENAMES else r
            for r in rules
        ]
    if arch.mla.q_lora_rank:
        rules += [
            WeightRule(
                f"{_SELF}.linear_q_down_proj.weight",
                (f"{_ATTN}.q_a_proj.weight",),
                Split.REPLICATED if te else Split.COLUMN,
            ),
            WeightRule(q_norm, (f"{_ATTN}.q_a_layernorm.weight",), Split.REPLICATED),
            WeightRule(f"{_SELF}.linear_q_up_proj.weight", (f"{_ATTN}.q_b_proj.weight",), Split.MLA_Q),
        ]
    else:
        rules.append(WeightRule(f"{_SELF}.linear_q_proj.weight", (f"{_ATTN}.q_proj.weight",), Split.MLA_Q))
    return rules


def rope_order(rope_dim: int, interleaved: bool) -> torch.Tensor:
    """The order to read a rope block's rows in so that Megatron-Core's de-interleave (even rows, then odd rows)
    yields the rotation halves: as stored for interleaved pairs, else [0, d/2, 1, d/2 + 1, ...]."""
    if interleaved:
        return torch.arange(rope_dim)
    half = rope_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=-1).reshape(-1)


def read_mla_shard(ckpt, split: Split, name: str, arch: ModelArch, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's rows of q_b_proj / q_proj (MLA_Q) or kv_a_proj_with_mqa (MLA_KV_DOWN[_FULL]), rope rows in
    the order Megatron-Core's MLA expects (rope_order)."""
    mla = arch.mla
    order = rope_order(mla.qk_rope_head_dim, mla.rope_interleave)
    if split is Split.MLA_Q:
        heads = arch.num_attention_heads // tp_size
        width = mla.qk_head_dim
        q = ckpt.read(name, rows=(tp_rank * heads * width, (tp_rank + 1) * heads * width))
        q = q.reshape(heads, width, *q.shape[1:])
        nope, rope = q[:, : mla.qk_nope_head_dim], q[:, mla.qk_nope_head_dim :]
        return torch.cat([nope, rope[:, order.to(rope.device)]], dim=1).reshape(heads * width, *q.shape[2:])
    # The whole down projection is small (hidden x (kv_lora_rank + rope)): read it, reorder, then slice.
    kv = ckpt.read(name)
    kv = torch.cat([kv[: mla.kv_lora_rank], kv[mla.kv_lora_rank :][order.to(kv.device)]], dim=0)
    if split is Split.MLA_KV_DOWN_FULL:
        return kv
    per = kv.shape[0] // tp_size
    return kv[tp_rank * per : (tp_rank + 1) * per].contiguous()


def mtp_weight_names(arch: ModelArch, names) -> list[str]:
    """The checkpoint's multi-token-prediction tensors (model.layers.{i >= num_layers}.*), which are never read."""
    pattern = re.compile(r"^model\.layers\.(\d+)\.")
    return sorted(n for n in names if (m := pattern.match(n)) and int(m.group(1)) >= arch.num_layers)
