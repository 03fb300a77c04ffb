"""SGLang draft classes for Osprey (``swap_h_and_emb``, own embedding, every layer fused) and deep EAGLE-3.

Imported only by SGLang (see the package docstring). Per forward, with ``g`` the fused target
features (``fc(aux)``, or the previous draft step's pre-norm hidden) and ``e`` the drafter's own
embedding: Osprey runs every layer on ``side = g, stream = e``; EAGLE-3 on ``side = e, stream = g``
in its first layer and, for ``eagle3_extra_layers = "plain"``, ordinary decoder layers after it.
A fused layer attends over ``cat(input_layernorm(side), hidden_norm(stream))`` with the stream as
its residual; the (hidden, residual) pair SGLang's fused-add norms carry is summed before each
fused layer so the stream is whole. Names follow megatron_osprey.export.layouts.
"""

from __future__ import annotations

import copy
from typing import Iterable, Tuple

import torch
from torch import nn

from sglang.srt.distributed import get_pp_group
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import QKVParallelLinear
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models.llama import LlamaDecoderLayer
from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3 as StockLlamaEagle3
from sglang.srt.models.qwen3 import Qwen3DecoderLayer
from sglang.srt.utils import add_prefix

from megatron_osprey.export.sglang_plugin.weight_names import layer_kinds, needs_plugin, plugin_param_name


def _make_fused(layer: nn.Module, config, quant_config, prefix: str) -> nn.Module:
    """Widen a decoder layer's QKV input to 2H and give it the stream norm."""
    attn = layer.self_attn
    attn.qkv_proj = QKVParallelLinear(
        2 * config.hidden_size, attn.head_dim, attn.total_num_heads, attn.total_num_kv_heads,
        bias=False, quant_config=quant_config, prefix=add_prefix("qkv_proj", prefix),
    )
    # Qwen3 layers leave the all-reduce to their LayerCommunicator, which a fused forward bypasses.
    if hasattr(attn.o_proj, "reduce_results"):
        attn.o_proj.reduce_results = True
    layer.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    return layer


def _fused_forward(layer, positions, side, stream, forward_batch):
    attn_in = torch.cat([layer.input_layernorm(side), layer.hidden_norm(stream)], dim=-1)
    out = layer.self_attn(positions=positions, hidden_states=attn_in, forward_batch=forward_batch)
    out, residual = layer.post_attention_layernorm(out, stream)
    return layer.mlp(out), residual


class OspreyDraftModel(nn.Module):
    """Embedding, fc, fused/plain layers and final norm; returns (hidden for logits, [pre-norm hidden])."""

    def __init__(self, config, layer_cls, quant_config=None, prefix: str = ""):
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=add_prefix("embed_tokens", prefix))
        target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
        self.fc = nn.Linear(3 * target_hidden, config.hidden_size, bias=False)
        self.kinds = layer_kinds(config)
        layers = []
        for index, kind in enumerate(self.kinds):
            layer_prefix = add_prefix(f"layers.{index}", prefix)
            layer = layer_cls(config, index, quant_config=quant_config, prefix=layer_prefix)
            layers.append(_make_fused(layer, config, quant_config, layer_prefix) if kind == "fused" else layer)
        self.layers = nn.ModuleList(layers)
        self.swap_h_and_emb = bool(getattr(config, "swap_h_and_emb", False))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
        embeds = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        g = forward_batch.spec_info.hidden_states
        if g.shape[-1] != embeds.shape[-1]:  # fresh target taps: 3*Ht wide
            g = self.fc(g)
        if g.shape[0] == 0:  # idle batch
            return g, [g]
        side, stream = (g, embeds) if self.swap_h_and_emb else (embeds, g)
        residual = None
        for kind, layer in zip(self.kinds, self.layers):
            if kind == "fused":
                if residual is not None:
                    stream, residual = stream + residual, None
                stream, residual = _fused_forward(layer, positions, side, stream, forward_batch)
            else:
                stream, residual = layer(positions, stream, forward_batch, residual)
        to_logits, to_aux = self.norm(stream, residual)
        return to_logits, [to_aux]


class LlamaForCausalLMEagle3(StockLlamaEagle3):
    """SGLang's EAGLE-3 draft class, extended to Osprey and deep EAGLE-3 drafts; stock behaviour otherwise."""

    layer_cls = LlamaDecoderLayer

    def __init__(self, config, quant_config=None, prefix: str = ""):
        self.osprey_plugin = needs_plugin(config) or type(self) is not LlamaForCausalLMEagle3
        if not self.osprey_plugin:
            super().__init__(config, quant_config=quant_config, prefix=prefix)
            return
        nn.Module.__init__(self)
        self.osprey_plugin = True
        self.config = config
        self.quant_config = quant_config
        self.pp_group = get_pp_group()
        self.model = OspreyDraftModel(config, self.layer_cls, quant_config, add_prefix("model", prefix))
        if getattr(config, "draft_vocab_size", None) is None:
            raise ValueError("an Osprey draft config.json must set draft_vocab_size (tools/export_checkpoint.py does).")
        self.load_lm_head_from_target = False
        self.lm_head = ParallelLMHead(config.draft_vocab_size, config.hidden_size, quant_config=quant_config,
                                      prefix=add_prefix("lm_head", prefix))
        logits_config = copy.deepcopy(config)
        logits_config.vocab_size = config.draft_vocab_size  # the draft head's own vocabulary
        self.logits_processor = LogitsProcessor(logits_config)
        self.capture_aux_hidden_states = True
        self.hot_token_id = None
        self.loaded_own_embedding = False

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Load an exported draft; the stacked q/k/v and gate/up shards go through SGLang's loaders."""
        if not self.osprey_plugin:
            return super().load_weights(weights)
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if name == "d2t":  # draft id -> target id offsets
                self.hot_token_id = tensor + torch.arange(tensor.shape[0], device=tensor.device)
                continue
            mapped = plugin_param_name(name)
            if mapped is None:
                continue
            param_name, shard = mapped
            if param_name not in params:
                raise KeyError(f"draft checkpoint tensor {name!r} maps to {param_name!r}, which this model lacks.")
            param = params[param_name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor) if shard is None else loader(param, tensor, shard)
            self.loaded_own_embedding |= param_name == "model.embed_tokens.weight"
        if not self.loaded_own_embedding:
            raise RuntimeError("this draft checkpoint has no embed_tokens.weight; re-export it with tools/export_checkpoint.py.")

    def set_embed(self, embed):
        """Keep the drafter's own (vocabulary-aligned) embedding instead of the target's."""
        if self.osprey_plugin and self.loaded_own_embedding:
            return
        return super().set_embed(embed)

    def get_hot_token_id(self):
        return self.hot_token_id


class Qwen3ForCausalLMEagle3(LlamaForCausalLMEagle3):
    """The same draft on Qwen3 layers (per-head q/k RMSNorm), Osprey's name for Qwen3-bodied drafters."""

    layer_cls = Qwen3DecoderLayer


EntryClass = [LlamaForCausalLMEagle3, Qwen3ForCausalLMEagle3]
