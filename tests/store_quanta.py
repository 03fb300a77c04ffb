"""Store values against a float32 reference, measured in quanta of the store's encoding."""

from __future__ import annotations

import torch


def error_in_quanta(stored: torch.Tensor, reference: torch.Tensor, encoding: str, groups: int) -> float:
    """Largest |stored - reference| in units of the encoding's quantum at each value.

    bf16: the spacing of bf16 numbers at the reference value (8 significant bits).
    int8 (8 outliers per token, the default): per token and layer group, the 9th largest magnitude / 127 (the 8 largest
    channels are kept in bf16, so the 9th sets the int8 step). Both are floored at
    2^-16 of the row's largest value: near zero the quantum shrinks below the float32
    difference between the Megatron and HF forwards (~1e-7), which is no store error.
    Exact rounding is off by at most half a quantum.
    """
    rows = reference.abs().reshape(reference.shape[0], groups, -1)
    _, exponent = torch.frexp(reference)
    quantum = torch.ldexp(torch.ones_like(reference), exponent - 8)
    floor = (rows.amax(-1, keepdim=True) * 2.0**-16).expand_as(rows).reshape(reference.shape)
    quantum = torch.maximum(quantum, floor)
    if encoding == "int8":
        step = (rows.topk(9, dim=-1).values[..., -1:] / 127).expand_as(rows).reshape(reference.shape)
        quantum = torch.maximum(quantum, step)
    return ((stored - reference).abs() / quantum).max().item()
