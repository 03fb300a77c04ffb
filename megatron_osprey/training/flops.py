"""Training FLOPs of a GPT step (attention, MLP and the LM head) and MFU against a device's peak."""

from __future__ import annotations

import torch

from megatron_osprey.base.arch import ModelArch

# Dense (no sparsity) peak TFLOP/s per device, BF16 tensor cores; FP8 is twice that.
# Matched against torch.cuda.get_device_name() by substring, first match wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("GH200", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("V100", 125.0),
)


def forward_flops_per_sequence(arch: ModelArch, seq_length: int, lm_head_width: int) -> float:
    """Forward FLOPs for one sequence: 2 per multiply-add, causal attention counts its lower triangle.

    lm_head_width is the padded vocabulary the LM head computes (0: no head). The MLP is gated
    (SwiGLU) in every family ModelArch describes.
    """
    s, h = seq_length, arch.hidden_size
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_query_groups * arch.head_dim
    projections = 2 * s * h * (q + 2 * kv) + 2 * s * q * h  # QKV and output projection
    # QK^T and softmax(.)V over the causal half: each query sees (s + 1) / 2 keys on average.
    attention = 2 * 2 * s * q * (s + 1) / 2
    mlp = 2 * s * h * arch.ffn_hidden_size * 3
    lm_head = 2 * s * h * lm_head_width
    return arch.num_layers * (projections + attention + mlp) + lm_head


def training_flops_per_sequence(arch: ModelArch, seq_length: int, lm_head_width: int) -> float:
    """Forward + backward (twice the forward) FLOPs for one sequence, no activation recompute."""
    return 3.0 * forward_flops_per_sequence(arch, seq_length, lm_head_width)


def device_peak_tflops(override: float | None = None, fp8: bool = False) -> float | None:
    """Per-device peak: the override, else the table by CUDA device name; None on CPU or unknown GPUs."""
    if override is not None:
        return float(override)
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * (2.0 if fp8 else 1.0)
    return None


def mfu(achieved_tflops_per_device: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilization in [0, 1], or None when the peak is unknown."""
    if not peak_tflops:
        return None
    return achieved_tflops_per_device / peak_tflops
