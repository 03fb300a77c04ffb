"""Training-time-test attention in memory linear in the sequence length and the step count.

At TTT step k the queries of position t attend to the step-0 keys 0..t (causal)
plus the keys of steps 1..k at position t (the "diagonal"). Written as one masked
softmax over the concatenated keys this is a [s, (k+1)*s] score matrix per head:
O(K * s^2) memory over a K-step unroll, which at seq 4096 and K=5 is tens of GiB.

`ttt_attention` computes the same function from a fused causal attention and k
per-row dot products. The diagonal terms of a row collapse into one virtual key:
score D = logsumexp_i(d_i), value V = softmax(d) @ v_i. That key joins the
step-0 block as a "sink" key visible to every query (an extra key at position 0
behind an extra dummy query row, so the causal kernel still applies): its score
is carried in two extra query channels (hi and lo parts of D, so that a bf16 query
keeps D to ~16 bits) against a sink key of ones in those channels, and its weight
comes out of an extra value channel. The output is then
`sdpa_main + sink_weight * V`, and autograd through the fused kernel gives exact
gradients: nothing but public `scaled_dot_product_attention` with `is_causal`, so
the kernel is flash / memory-efficient on GPU and the fused CPU kernel on CPU.
The channel count is padded to a multiple of 8, which the fused GPU kernels need
(they silently fall back to the quadratic math kernel otherwise).

Layout: [batch, heads, seq, head_dim] (SDPA's). Keys and values are given per
step, step 0 first, each [batch, kv_heads, seq, head_dim]; grouped-query
attention repeats kv heads over `heads // kv_heads` queries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from megatron_osprey.base.memory import TTT_ALIGN as _ALIGN
from megatron_osprey.base.memory import TTT_SINK_CHANNELS as _SINK_CHANNELS


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _diagonal_key(query: Tensor, keys: list[Tensor], values: list[Tensor], scale: float, groups: int):
    """(D [b, h, s] float32, V [b, h, s, d] float32): the diagonal keys of a row merged into one."""
    kd = torch.stack([_repeat_kv(k, groups) for k in keys], dim=-2)  # [b, h, s, n, d]
    vd = torch.stack([_repeat_kv(v, groups) for v in values], dim=-2)
    scores = (query.unsqueeze(-2).float() * kd.float()).sum(-1) * scale  # [b, h, s, n]
    merged_score = torch.logsumexp(scores, dim=-1)
    merged_value = (torch.softmax(scores, dim=-1).unsqueeze(-1) * vd.float()).sum(-2)
    return merged_score, merged_value


def ttt_attention(query: Tensor, keys: list[Tensor], values: list[Tensor], scale: float) -> Tensor:
    """TTT attention of `query` (step len(keys)-1) over step-0 keys (causal) and steps 1.. (diagonal)."""
    if len(keys) != len(values) or not keys:
        raise ValueError("ttt_attention needs one key and one value tensor per step (step 0 first).")
    heads, kv_heads = query.shape[1], keys[0].shape[1]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads}).")
    groups = heads // kv_heads
    k0, v0 = _repeat_kv(keys[0], groups), _repeat_kv(values[0], groups)
    if len(keys) == 1:
        return F.scaled_dot_product_attention(query, k0, v0, is_causal=True, scale=scale)

    # Recomputed in backward: kept, its float32 copies of the stacked diagonal keys and values would be
    # the largest activation of the unroll (2 x [b, h, s, k, d] x 4 bytes per step); recomputing costs
    # O(s * k * d) flops and gives bitwise the same values, so the result is unchanged.
    merged_score, merged_value = checkpoint(
        _diagonal_key, query, keys[1:], values[1:], scale, groups, use_reentrant=False
    )
    b, h, s, d = query.shape
    width = -(-(d + _SINK_CHANNELS) // _ALIGN) * _ALIGN
    # The sink's score is scale * (hi + lo) * 1: D / scale split so that hi + lo == D / scale.
    target = merged_score / scale
    hi = target.to(query.dtype)
    lo = (target - hi.float()).to(query.dtype)
    pad = width - d - _SINK_CHANNELS
    q_rows = torch.cat([query, hi.unsqueeze(-1), lo.unsqueeze(-1), query.new_zeros(b, h, s, pad)], dim=-1)
    k_rows = F.pad(k0, (0, width - d))
    v_rows = F.pad(v0, (0, width - d))
    sink_key = query.new_zeros(b, h, 1, width)
    sink_key[..., d : d + _SINK_CHANNELS] = 1
    sink_value = query.new_zeros(b, h, 1, width)
    sink_value[..., d] = 1
    # Row 0 is a dummy query so that, under the causal mask, query t sees the sink and keys 0..t.
    q_full = torch.cat([query.new_zeros(b, h, 1, width), q_rows], dim=2)
    k_full = torch.cat([sink_key, k_rows], dim=2)
    v_full = torch.cat([sink_value, v_rows], dim=2)
    out = F.scaled_dot_product_attention(q_full, k_full, v_full, is_causal=True, scale=scale)[:, :, 1:]
    sink_weight = out[..., d : d + 1].float()
    return (out[..., :d].float() + sink_weight * merged_value).to(query.dtype)


def exact_ttt_attention(query: Tensor, keys: list[Tensor], values: list[Tensor], scale: float) -> Tensor:
    """The definition: one masked softmax over all steps' keys, O(K * s^2) memory.

    Kept as the reference `ttt_attention` is tested and benchmarked against; not for training.
    """
    groups = query.shape[1] // keys[0].shape[1]
    s = query.shape[2]
    all_keys = torch.cat([_repeat_kv(k, groups) for k in keys], dim=2)
    all_values = torch.cat([_repeat_kv(v, groups) for v in values], dim=2)
    causal = torch.ones(s, s, dtype=torch.bool, device=query.device).tril()
    diagonal = torch.eye(s, dtype=torch.bool, device=query.device)
    allowed = torch.cat([causal] + [diagonal] * (len(keys) - 1), dim=1)
    scores = (query.float() @ all_keys.float().transpose(-1, -2)) * scale
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return (probs @ all_values.float()).to(query.dtype)
