"""sglang.srt.models.llama stand-in: LlamaMLP, LlamaAttention, LlamaDecoderLayer (with stage_boundaries)
and LlamaForCausalLM's forward, for one prefill sequence at TP 1."""

import math

import torch
from torch import nn

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sglang.srt.utils import add_prefix


def _rope_theta_of(config, default: float) -> float:
    """rope_theta from rope_parameters (transformers 5) or the config attribute, as SGLang reads it."""
    parameters = getattr(config, "rope_parameters", None)
    if parameters is not None and "rope_theta" in parameters:
        scaling = parameters.get("rope_type", "default")
        if scaling not in (None, "default"):
            raise NotImplementedError(f"the stand-in rotary embedding has no {scaling!r} scaling")
        return float(parameters["rope_theta"])
    if getattr(config, "rope_scaling", None):
        raise NotImplementedError("the stand-in rotary embedding has no rope scaling")
    return float(getattr(config, "rope_theta", default))


def _neox_rope(positions, x, head_dim, theta):
    """Rotate-half (neox) RoPE of x [tokens, heads * head_dim] at positions [tokens]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None]
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
    x = x.view(x.shape[0], -1, head_dim)
    half = head_dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).flatten(1)


def _causal_attention(q, k, v, num_heads, num_kv_heads, head_dim):
    """Causal softmax attention of one sequence; q [T, h*d], k/v [T, kv*d] -> [T, h*d]."""
    t = q.shape[0]
    q = q.view(t, num_heads, head_dim).transpose(0, 1)
    k = k.view(t, num_kv_heads, head_dim).transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, 0)
    v = v.view(t, num_kv_heads, head_dim).transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, 0)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(head_dim)
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(0, 1).reshape(t, -1)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size, hidden_act, quant_config=None, prefix="",
                 reduce_results=True, parallel_group="tp", use_dp_attention_reduce=False):
        super().__init__()
        assert hidden_act == "silu"
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, reduce_results=reduce_results)

    def forward(self, x, forward_batch=None):
        gate_up, _ = self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        x, _ = self.down_proj(nn.functional.silu(gate) * up)
        return x


class LlamaAttention(nn.Module):
    def __init__(self, config, hidden_size, num_heads, num_kv_heads, layer_id=0, start_layer=0, rope_theta=10000,
                 rope_scaling=None, rope_is_neox_style=True, max_position_embeddings=8192, quant_config=None,
                 prefix="", bias=False, reduce_results=True):
        super().__init__()
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden_size // num_heads
        self.q_size, self.kv_size = num_heads * self.head_dim, num_kv_heads * self.head_dim
        self.rope_theta = rope_theta
        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_dim, num_heads, num_kv_heads, bias=bias)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden_size, bias=bias,
                                        reduce_results=reduce_results)

    def forward(self, positions, hidden_states, forward_batch):
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = _neox_rope(positions, q, self.head_dim, self.rope_theta)
        k = _neox_rope(positions, k, self.head_dim, self.rope_theta)
        out, _ = self.o_proj(_causal_attention(q, k, v, self.num_heads, self.num_kv_heads, self.head_dim))
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id=0, start_layer=0, quant_config=None, prefix="", stage_boundaries=True):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = LlamaAttention(
            config=config, hidden_size=self.hidden_size, num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads, layer_id=layer_id, rope_theta=_rope_theta_of(config, 10000),
            prefix=add_prefix("self_attn", prefix), bias=getattr(config, "attention_bias", False),
            reduce_results=not stage_boundaries)
        self.mlp = LlamaMLP(self.hidden_size, config.intermediate_size, config.hidden_act,
                            prefix=add_prefix("mlp", prefix), reduce_results=not stage_boundaries)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.stage_boundaries = stage_boundaries

    def forward(self, positions, hidden_states, forward_batch, capture_output=None):
        # SGLang 0.5.23 carries the residual inside stage boundaries; the stand-in has none.
        raise NotImplementedError("the stand-in LlamaDecoderLayer has no stage boundaries; drive its parts instead")


class LlamaForCausalLM(nn.Module):
    def forward(self, input_ids, positions, forward_batch, input_embeds=None, get_embedding=False,
                pp_proxy_tensors=None):
        hidden_states = self.model(input_ids, positions, forward_batch, input_embeds,
                                   pp_proxy_tensors=pp_proxy_tensors)
        aux_hidden_states = None
        if self.capture_aux_hidden_states:
            hidden_states, aux_hidden_states = hidden_states
        return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch, aux_hidden_states)

    def get_embed(self):
        return self.model.embed_tokens.weight

    def set_embed(self, embed):
        del self.model.embed_tokens.weight
        self.model.embed_tokens.weight = embed
