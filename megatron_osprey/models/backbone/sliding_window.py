"""Megatron-Core's local DotProductAttention with its sliding-window mask built where the scores are.

Megatron-Core 0.16.1 makes that mask with device="cuda" (transformer/utils.py get_sliding_window_causal_mask), so
the local spec's sliding-window layers (gpt-oss) cannot run on a CPU; the mask here is the same boolean [sq, sk].
"""

from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_osprey.models.backbone.glm_gptoss import sliding_window_mask


class SlidingWindowDotProductAttention(DotProductAttention):
    """DotProductAttention whose sliding-window mask is made on the query's device."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.osprey_window = self.scale_mask_softmax.window_size
        self.scale_mask_softmax.window_size = None  # Megatron-Core's own mask would be made on "cuda"

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        if self.osprey_window is not None and attention_mask is None:
            attention_mask = sliding_window_mask(query.size(0), key.size(0), self.osprey_window, query.device)
        return super().forward(query, key, value, attention_mask, *args, **kwargs)
