"""MXFP4 expert weights (gpt-oss checkpoints), dequantized as they are read, one expert at a time.

OCP Microscaling FP4: each block of 32 values is 32 FP4 (E2M1) codes packed two per byte (the low nibble first)
and one shared E8M0 scale byte, the power of two 2^(scale - 127). gpt-oss stores an expert tensor X as
`X_blocks` [experts, out, in / 32, 16] uint8 and `X_scales` [experts, out, in / 32] uint8; the dequantized expert
is [out, in], which HF's bf16 checkpoints store transposed, as `X` [experts, in, out]. `read_expert` returns the
bf16 layout either way, so the weight map has one rule per tensor.
"""

from __future__ import annotations

import torch

BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
VALUES_PER_BLOCK = 32
# E2M1 codes 0..15: sign bit, two exponent bits, one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., n_blocks, 16] uint8 codes and [..., n_blocks] uint8 scales -> [..., n_blocks x 32] values."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}.")
    if blocks.shape[-1] != VALUES_PER_BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}: expected "
            f"[..., n, 16] and [..., n]."
        )
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # low nibble first
    values = table[codes] * torch.exp2(scales.float() - SCALE_BIAS).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def quantize_mxfp4(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., n x 32] float -> (blocks, scales), rounding to the nearest FP4 value under each block's least
    power-of-two scale that keeps its largest magnitude within 6; writes tiny MXFP4 checkpoints for tests."""
    grouped = values.float().reshape(*values.shape[:-1], -1, VALUES_PER_BLOCK)
    peak = grouped.abs().amax(-1).clamp_min(2.0**-100)
    exponent = torch.ceil(torch.log2(peak / 6.0))  # peak / 2^e in (3, 6]
    scaled = grouped / torch.exp2(exponent).unsqueeze(-1)
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = (scaled.unsqueeze(-1) - table).abs().argmin(-1).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent + SCALE_BIAS).clamp(0, 255).to(torch.uint8)


def read_expert(ckpt, name: str, expert: int) -> torch.Tensor:
    """One expert of `name` in HF's bf16 layout ([in, out] weights, [out] biases), dequantized if MXFP4."""
    if ckpt.has(name):
        return ckpt.read(name, rows=(expert, expert + 1))[0]
    blocks, scales = name + BLOCKS_SUFFIX, name + SCALES_SUFFIX
    if not (ckpt.has(blocks) and ckpt.has(scales)):
        raise KeyError(f"{ckpt.directory}: neither {name} nor its MXFP4 {blocks} + {scales} is in the checkpoint.")
    out = dequantize_mxfp4(
        ckpt.read(blocks, rows=(expert, expert + 1))[0], ckpt.read(scales, rows=(expert, expert + 1))[0]
    )
    return out.to(ckpt.dequantized_dtype).T  # [out, in] -> [in, out]
