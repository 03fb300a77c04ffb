"""sglang.srt.layers.linear stand-in at TP 1: the (output, bias) return and the shard weight loaders."""

import torch
from torch import nn


class _Linear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        assert loaded_shard_id is None and param.shape == loaded_weight.shape, (param.shape, loaded_weight.shape)
        param.data.copy_(loaded_weight)

    def forward(self, input_):
        return nn.functional.linear(input_, self.weight, self.bias), None


class RowParallelLinear(_Linear):
    def __init__(self, input_size, output_size, bias=True, input_is_parallel=True, skip_bias_add=False,
                 params_dtype=None, reduce_results=True, quant_config=None, prefix="", *,
                 use_presharded_weights=False, use_dp_attention_reduce=False, parallel_group=None):
        super().__init__(input_size, output_size, bias)
        self.reduce_results = reduce_results  # a sum over TP ranks; nothing to sum at TP 1

    def weight_loader(self, param, loaded_weight):
        super().weight_loader(param, loaded_weight)

    def forward(self, input_, skip_all_reduce=False, forward_batch=None, output_tensor=None):
        return super().forward(input_)


class MergedColumnParallelLinear(_Linear):
    def __init__(self, input_size, output_sizes, bias=True, gather_output=False, skip_bias_add=False,
                 params_dtype=None, quant_config=None, prefix="", *, use_presharded_weights=False,
                 parallel_group=None):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias)

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        start = sum(self.output_sizes[:loaded_shard_id])
        assert loaded_weight.shape == (self.output_sizes[loaded_shard_id], self.input_size)
        param.data[start : start + loaded_weight.shape[0]].copy_(loaded_weight)


class QKVParallelLinear(_Linear):
    def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads=None, bias=True,
                 skip_bias_add=False, params_dtype=None, quant_config=None, prefix="", *, load_presharded_attn=False,
                 v_head_size=None, skip_block_quant_check=False, parallel_group=None, kv_parallel_group=None):
        self.head_size, self.total_num_heads = head_size, total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.q_size, self.kv_size = total_num_heads * head_size, self.total_num_kv_heads * head_size
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        offset, size = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                        "v": (self.q_size + self.kv_size, self.kv_size)}[loaded_shard_id]
        assert loaded_weight.shape == (size, self.input_size), (loaded_weight.shape, size, self.input_size)
        param.data[offset : offset + size].copy_(loaded_weight)
