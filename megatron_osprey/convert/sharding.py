"""Tensor-parallel slicing of HF tensors into Megatron shards, and back."""

from __future__ import annotations

import torch

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.convert.safetensors_io import SafetensorsCheckpoint
from megatron_osprey.convert.weight_map import Split, WeightRule


def _part(total: int, rank: int, size: int) -> tuple[int, int]:
    per = total // size
    return rank * per, (rank + 1) * per


def read_shard(
    ckpt: SafetensorsCheckpoint,
    rule: WeightRule,
    hf_names: list[str],
    arch: ModelArch,
    tp_rank: int,
    tp_size: int,
) -> torch.Tensor:
    """Read from disk only the slice of `hf_names` that TP rank `tp_rank` holds."""
    split = rule.split
    if split in (Split.MLA_Q, Split.MLA_KV_DOWN, Split.MLA_KV_DOWN_FULL):
        from megatron_osprey.convert.deepseek_v3 import read_mla_shard

        return read_mla_shard(ckpt, split, hf_names[0], arch, tp_rank, tp_size)
    if split is Split.REPLICATED:
        return ckpt.read(hf_names[0])
    if split is Split.COLUMN:
        return ckpt.read(hf_names[0], rows=_part(ckpt.shape(hf_names[0])[0], tp_rank, tp_size))
    if split is Split.ROW:
        return ckpt.read(hf_names[0], cols=_part(ckpt.shape(hf_names[0])[1], tp_rank, tp_size))
    if split is Split.VOCAB:
        padded = arch.padded_vocab_size(tp_size)
        start, end = _part(padded, tp_rank, tp_size)
        real_end = min(end, arch.vocab_size)
        shape = ckpt.shape(hf_names[0])
        out = ckpt.read(hf_names[0], rows=(0, 0)).new_zeros((end - start, *shape[1:]))
        if real_end > start:
            out[: real_end - start] = ckpt.read(hf_names[0], rows=(start, real_end))
        return out
    if split is Split.QKV:
        d, hpg = arch.head_dim, arch.heads_per_group
        groups = arch.num_query_groups // tp_size
        g0 = tp_rank * groups
        q = ckpt.read(hf_names[0], rows=(g0 * hpg * d, (g0 + groups) * hpg * d))
        k = ckpt.read(hf_names[1], rows=(g0 * d, (g0 + groups) * d))
        v = ckpt.read(hf_names[2], rows=(g0 * d, (g0 + groups) * d))
        rest = q.shape[1:]
        fused = torch.cat(
            [q.reshape(groups, hpg * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)],
            dim=1,
        )
        return fused.reshape(groups * (hpg + 2) * d, *rest)
    if split is Split.GATE_UP:
        # The gate's own row count: the dense FFN size, or an expert's (moe_intermediate_size).
        rows = _part(ckpt.shape(hf_names[0])[0], tp_rank, tp_size)
        return torch.cat([ckpt.read(hf_names[0], rows=rows), ckpt.read(hf_names[1], rows=rows)], dim=0)
    raise ValueError(f"unknown split {split}")


def merge_shards(
    rule: WeightRule, shards: list[torch.Tensor], hf_names: list[str], arch: ModelArch
) -> dict[str, torch.Tensor]:
    """Invert `read_shard`: all TP ranks' shards of one parameter -> the HF tensors."""
    split = rule.split
    if split is Split.REPLICATED:
        return {hf_names[0]: shards[0]}
    if split is Split.COLUMN:
        return {hf_names[0]: torch.cat(shards, dim=0)}
    if split is Split.ROW:
        return {hf_names[0]: torch.cat(shards, dim=1)}
    if split is Split.VOCAB:
        return {hf_names[0]: torch.cat(shards, dim=0)[: arch.vocab_size]}
    if split is Split.QKV:
        d, hpg = arch.head_dim, arch.heads_per_group
        full = torch.cat(shards, dim=0)
        rest = full.shape[1:]
        grouped = full.reshape(arch.num_query_groups, (hpg + 2) * d, *rest)
        q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
        return {
            hf_names[0]: q.reshape(-1, *rest),
            hf_names[1]: k.reshape(-1, *rest),
            hf_names[2]: v.reshape(-1, *rest),
        }
    if split is Split.GATE_UP:
        halves = [torch.chunk(shard, 2, dim=0) for shard in shards]
        return {
            hf_names[0]: torch.cat([h[0] for h in halves], dim=0),
            hf_names[1]: torch.cat([h[1] for h in halves], dim=0),
        }
    raise ValueError(f"unknown split {split}")
