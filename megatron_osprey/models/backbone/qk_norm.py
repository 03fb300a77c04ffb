"""RMSNorm of q or k over the whole projection (all heads at once), tensor-parallel aware.

MiniMax-M2 (`qk_norm_type: per_layer`) normalizes `q_proj(x)` as one vector of
num_heads x head_dim channels, with a weight per channel, before splitting heads.
Megatron-Core's qk_layernorm normalizes each head on its own, which is a different
function. Under tensor parallelism each rank holds only its heads, so the sum of
squares is all-reduced over the TP group before the division.
"""

from __future__ import annotations

import torch

_ROLES = ("query", "key")


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose gradient is the all-reduced gradient: every rank's output uses every rank's input."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        tensor = tensor.clone()
        torch.distributed.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class ProjectionRMSNorm(torch.nn.Module):
    """RMSNorm over [.., heads, head_dim] as one vector; the weight is this rank's heads' slice."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, role: str = "query", **_unused):
        super().__init__()
        if role not in _ROLES:
            raise ValueError(f"ProjectionRMSNorm role must be one of {_ROLES}, got {role!r}.")
        from megatron.core import parallel_state as mpu

        self.tp_size = mpu.get_tensor_model_parallel_world_size()
        heads = config.num_attention_heads if role == "query" else config.num_query_groups
        if heads % self.tp_size:
            raise ValueError(
                f"--tensor-model-parallel-size {self.tp_size} must divide the {role} heads ({heads}) "
                f"for the whole-projection q/k norm."
            )
        self.total_channels = heads * hidden_size
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(heads // self.tp_size * hidden_size, dtype=config.params_dtype))
        # Each rank holds a distinct slice: the weight is tensor-parallel, not replicated.
        setattr(self.weight, "tensor_model_parallel", True)
        setattr(self.weight, "partition_dim", 0)
        setattr(self.weight, "partition_stride", 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(*shape[:-2], shape[-2] * shape[-1]).float()
        sum_sq = flat.pow(2).sum(-1, keepdim=True)
        if self.tp_size > 1:
            from megatron.core import parallel_state as mpu

            sum_sq = _SumOverGroup.apply(sum_sq, mpu.get_tensor_model_parallel_group())
        normed = flat * torch.rsqrt(sum_sq / self.total_channels + self.eps)
        return (normed.to(x.dtype) * self.weight).reshape(shape)
