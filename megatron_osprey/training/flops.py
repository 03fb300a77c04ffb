"""Training FLOPs of a GPT step (attention, MLP and the LM head) and MFU against a device's peak."""

from __future__ import annotations

import dataclasses

import torch

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


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes that decide a decoder's FLOPs."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int  # the padded size the LM head actually computes
    gated_mlp: bool = True

    @classmethod
    def from_arch(cls, arch, padded_vocab_size: int) -> "ModelShape":
        return cls(arch.num_layers, arch.hidden_size, arch.ffn_hidden_size, arch.num_attention_heads,
                   arch.num_query_groups, arch.head_dim, padded_vocab_size)


def forward_flops_per_sequence(shape: ModelShape, seq_length: int) -> float:
    """Forward FLOPs for one sequence: 2 per multiply-add, causal attention counts its lower triangle."""
    s, h = seq_length, shape.hidden_size
    q = shape.num_attention_heads * shape.head_dim
    kv = shape.num_query_groups * shape.head_dim
    projections = 2 * s * h * (q + 2 * kv) + 2 * s * q * h  # QKV and output projection
    # QK^T and softmax(.)V over the causal half: each query sees (s + 1) / 2 keys on average.
    attention = 2 * 2 * s * q * (s + 1) / 2
    mlp = 2 * s * h * shape.ffn_hidden_size * (3 if shape.gated_mlp else 2)
    lm_head = 2 * s * h * shape.vocab_size
    return shape.num_layers * (projections + attention + mlp) + lm_head


def training_flops_per_sequence(shape: ModelShape, seq_length: int) -> float:
    """Forward + backward (twice the forward) FLOPs for one sequence, no activation recompute."""
    return 3.0 * forward_flops_per_sequence(shape, seq_length)


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
