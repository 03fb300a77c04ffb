"""sglang.srt.models.qwen3 stand-in: Qwen3Attention (per-head q/k RMSNorm before RoPE) and Qwen3DecoderLayer,
whose o_proj and MLP leave their TP sums to the layer's stage boundaries (reduce_results=False), as in 0.5.23."""

import torch
from torch import nn

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import QKVParallelLinear, RowParallelLinear
from sglang.srt.models.llama import _causal_attention, _neox_rope, _rope_theta_of
from sglang.srt.models.qwen2 import Qwen2MLP as Qwen3MLP
from sglang.srt.utils import add_prefix


class Qwen3Attention(nn.Module):
    def __init__(self, hidden_size, num_heads, num_kv_heads, layer_id=0, start_layer=0, rope_theta=1000000,
                 rope_scaling=None, head_dim=None, max_position_embeddings=32768, quant_config=None,
                 rms_norm_eps=None, attention_bias=False, prefix="", alt_stream=None):
        super().__init__()
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = head_dim or hidden_size // num_heads
        self.q_size, self.kv_size = num_heads * self.head_dim, num_kv_heads * self.head_dim
        self.rope_theta = rope_theta
        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_dim, num_heads, num_kv_heads, bias=attention_bias)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden_size, bias=attention_bias,
                                        reduce_results=False)
        self.q_norm = RMSNorm(self.head_dim, eps=rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=rms_norm_eps)

    def forward(self, positions, hidden_states, forward_batch):
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        q = _neox_rope(positions, q, self.head_dim, self.rope_theta)
        k = _neox_rope(positions, k, self.head_dim, self.rope_theta)
        out, _ = self.o_proj(_causal_attention(q, k, v, self.num_heads, self.num_kv_heads, self.head_dim))
        return out


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config, layer_id=0, start_layer=0, quant_config=None, prefix="", alt_stream=None):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = Qwen3Attention(
            hidden_size=self.hidden_size, num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads, layer_id=layer_id, rope_theta=_rope_theta_of(config, 1000000),
            head_dim=getattr(config, "head_dim", None), rms_norm_eps=config.rms_norm_eps,
            attention_bias=getattr(config, "attention_bias", False), prefix=add_prefix("self_attn", prefix))
        self.mlp = Qwen3MLP(self.hidden_size, config.intermediate_size, config.hidden_act,
                            prefix=add_prefix("mlp", prefix), reduce_results=False)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, forward_batch, post_residual_addition=None, capture_output=None):
        # SGLang 0.5.23 returns one tensor and carries the residual inside stage boundaries.
        raise NotImplementedError("the stand-in Qwen3DecoderLayer has no stage boundaries; drive its parts instead")
