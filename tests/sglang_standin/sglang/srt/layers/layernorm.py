"""sglang.srt.layers.layernorm stand-in: RMSNorm with SGLang's fused residual add (forward_native)."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, var_hidden_size=None, cast_x_before_out_mul=False,
                 fp32_residual=False, has_weight=True, weight_dtype=None, override_orig_dtype=None,
                 x_pad_to_multiple=0, force_native=False):
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x, residual=None, post_residual_addition=None, quant_linear=None):
        """norm(x), or with a residual: (norm(x + residual), x + residual) (SGLang's forward_native)."""
        if post_residual_addition is not None or quant_linear is not None:
            raise NotImplementedError("the stand-in RMSNorm has no post-residual addition or fused quantized linear")
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        if residual is not None:
            x = x + residual.to(torch.float32)
            residual = x.to(orig_dtype)
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"Expected hidden_size to be {self.hidden_size}, but found: {x.shape[-1]}")
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.variance_epsilon)
        x = (x * self.weight.to(torch.float32)).to(orig_dtype)
        return x if residual is None else (x, residual)
