"""What Megatron-Core's GPT spec lacks for Mistral's and Gemma 3's blocks, written as modules its spec takes.

Megatron-Core already holds: q/k/v biases (Qwen2: add_qkv_bias), per-head q/k norms, a gated MLP with any
activation (Gemma's GeGLU), the attention scale (softmax_scale = query_pre_attn_scalar^-1/2), and a per-layer
sliding-window pattern in its config (window_size, window_attn_skip_freq) that Transformer Engine's attention
runs. What it lacks, and this module adds (local spec):

- the local attention builds its window mask on CUDA only: models/backbone/sliding_window.py (shared with gpt-oss)
  builds it where the scores are.
- `LocalRopeSelfAttention`: one RoPE base per layer type. GPTModel computes one rotary table for every layer;
  Gemma 3's sliding layers rotate with rope_local_base_freq, unscaled, so those layers swap in their own table.
- `ZeroCenteredRMSNorm`: Gemma's RMSNorm, x / rms(x) * (1 + w) in float32 (torch's RMSNorm multiplies by w).
- `PostNormRowParallelLinear`: Gemma's sandwich norms. The norms after attention and after the MLP act on the
  outputs of o_proj and down_proj before the residual add, so they ride on those row-parallel layers (as
  `linear_proj.post_norm` / `linear_fc2.post_norm`); the layer's bias-dropout-add then adds the residual.
- `scale_embedding`: token embeddings times sqrt(hidden) in the weights' dtype, as Gemma3TextScaledWordEmbedding.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.models.backbone.sliding_window import SlidingWindowDotProductAttention


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm whose weight is stored zero-centred: x * rsqrt(mean(x^2) + eps) * (1 + w), in float32."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        # Replicated over TP; under sequence parallelism its grads are partial per rank.
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class PostNormRowParallelLinear(RowParallelLinear):
    """A row-parallel linear followed by a norm of its (reduced) output: Gemma's post-attention / post-MLP norm."""

    def __init__(self, input_size: int, output_size: int, *, config, post_norm=ZeroCenteredRMSNorm, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_norm = post_norm(config=config, hidden_size=output_size, eps=config.layernorm_epsilon)

    def forward(self, input_: torch.Tensor, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        if bias is not None:
            raise ValueError("a post-norm linear cannot defer its bias (add_bias_linear must be false).")
        return self.post_norm(output), None


class LocalRopeSelfAttention(SelfAttention):
    """Self-attention whose sliding-window layers rotate with their own RoPE base (Gemma 3's local layers)."""

    def __init__(self, config, submodules, layer_number: int, *args, local_inv_freq=None, **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        local = local_inv_freq is not None and is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number
        )
        self.local_inv_freq = torch.as_tensor(local_inv_freq) if local else None

    def forward(self, *args, rotary_pos_emb=None, **kwargs):
        if self.local_inv_freq is not None and rotary_pos_emb is not None:
            rotary_pos_emb = self._local_table(rotary_pos_emb)
        return super().forward(*args, rotary_pos_emb=rotary_pos_emb, **kwargs)

    def _local_table(self, global_table):
        """The local RoPE table over the same positions as GPTModel's [s, 1, 1, dim] table."""
        if isinstance(global_table, tuple):
            return tuple(None if t is None else self._local_table(t) for t in global_table)
        inv_freq = self.local_inv_freq.to(global_table.device)
        positions = torch.arange(global_table.shape[0], device=inv_freq.device, dtype=inv_freq.dtype)
        freqs = torch.outer(positions, inv_freq)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :].to(global_table.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' gelu_pytorch_tanh."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}


def needs_variant_spec(arch: ModelArch) -> bool:
    return bool(arch.sliding_window or local_spec_only(arch))


def local_spec_only(arch: ModelArch) -> bool:
    """Gemma 3's block (sandwich norms, (1 + w) RMSNorm, per-layer RoPE) is written for the local spec only."""
    return bool(arch.zero_centered_norm or arch.sandwich_norms or arch.local_rope_theta)


def variant_layer_spec(spec, arch: ModelArch, transformer_impl: str, local_inv_freq=None):
    """`spec` (Megatron-Core's GPT layer spec) with this module's swaps for `arch`."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_osprey.models.backbone.specs import replace_spec_submodules

    if transformer_impl != "local" and local_spec_only(arch):
        raise ValueError(
            f"{arch.family}'s block (sandwich norms, (1 + w) RMSNorm, per-layer RoPE) is built on the local spec "
            f"only: pass --transformer-impl local (or auto)."
        )
    spec = copy.deepcopy(spec)
    layer = spec.submodules
    attention = layer.self_attention
    if transformer_impl == "local" and arch.sliding_window:
        attention.submodules.core_attention = SlidingWindowDotProductAttention
    if arch.local_rope_theta:
        attention.module = LocalRopeSelfAttention
        attention.params = dict(attention.params or {}, local_inv_freq=local_inv_freq)
    if arch.zero_centered_norm:
        layer.input_layernorm = ZeroCenteredRMSNorm
        layer.pre_mlp_layernorm = ZeroCenteredRMSNorm
        if arch.qk_layernorm:
            attention.submodules.q_layernorm = ZeroCenteredRMSNorm
            attention.submodules.k_layernorm = ZeroCenteredRMSNorm
    if arch.sandwich_norms:
        attention.submodules.linear_proj = ModuleSpec(module=PostNormRowParallelLinear)
        layer.mlp = replace_spec_submodules(layer.mlp, linear_fc2=ModuleSpec(module=PostNormRowParallelLinear))
    return spec


def variant_block_spec(layer, arch: ModelArch, config, vp_stage: int | None = None):
    """The decoder block: `layer` repeated, with a zero-centred final norm where the family has one."""
    if not arch.zero_centered_norm:
        return layer
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=ZeroCenteredRMSNorm)


def variant_config_kwargs(arch: ModelArch) -> dict:
    """TransformerConfig fields for the family's activation, attention scale and sliding-window pattern."""
    kwargs: dict = {}
    if arch.hidden_act != "silu":
        kwargs.update(activation_func=ACTIVATIONS[arch.hidden_act], bias_activation_fusion=False)
    if arch.softmax_scale is not None:
        kwargs["softmax_scale"] = arch.softmax_scale
    if arch.sliding_window:
        # Megatron's window (left, right) counts the keys besides the query's own: HF's W is left + 1.
        kwargs["window_size"] = (arch.sliding_window - 1, 0)
        flags = arch.sliding_layer_flags
        kwargs["window_attn_skip_freq"] = None if all(flags) else [int(f) for f in flags]
    return kwargs


def _scale_output(multiplier: float, module, inputs, output):
    return output * torch.tensor(multiplier, dtype=torch.float32).to(output.dtype)


def scale_embedding(model, arch: ModelArch) -> None:
    """Multiply the token embeddings by the family's multiplier (cast to the weights' dtype, as HF does)."""
    if arch.embedding_multiplier != 1.0 and getattr(model, "pre_process", False):
        model.embedding.register_forward_hook(functools.partial(_scale_output, arch.embedding_multiplier))
