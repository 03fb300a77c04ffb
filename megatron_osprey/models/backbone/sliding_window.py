"""Megatron-Core's local DotProductAttention with its sliding-window mask built where the scores are.

Megatron-Core 0.16.1 makes that mask with device="cuda" (transformer/utils.py get_sliding_window_causal_mask), so
the local spec's sliding-window layers (Mistral, Gemma 3, gpt-oss) cannot run on a CPU; the mask here is the same
boolean [sq, sk]: a query at i sees keys i-W+1..i, HF's `kv_idx > q_idx - sliding_window`.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


def sliding_window_mask(sq: int, sk: int, window: tuple[int, int], device) -> torch.Tensor:
    """[sq, sk] bool, True where masked: keys outside [q - window[0], q + window[1]] (queries end-aligned)."""
    q = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    k = torch.arange(sk, device=device).unsqueeze(0)
    return (k < q - window[0]) | (k > q + window[1])


class SlidingWindowDotProductAttention(DotProductAttention):
    """DotProductAttention whose sliding-window mask is made on the query's device."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.window = self.scale_mask_softmax.window_size
        if self.window is not None:
            # Megatron-Core's own mask would be made on "cuda"; the mask is passed in explicitly instead, and a fused
            # softmax then honours it as a padding mask (its causal kernel would ignore it).
            self.scale_mask_softmax.window_size = None
            self.scale_mask_softmax.attn_mask_type = AttnMaskType.padding

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        if self.window is not None:
            window = sliding_window_mask(query.size(0), key.size(0), self.window, query.device)
            attention_mask = window if attention_mask is None else attention_mask | window
        return super().forward(query, key, value, attention_mask, *args, **kwargs)
