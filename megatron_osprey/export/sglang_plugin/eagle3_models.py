"""SGLang draft classes for drafters stock SGLang cannot serve: Osprey (every layer fused, own embedding,
``swap_h_and_emb``) and multi-layer EAGLE-3 (fused or plain extra layers).

Written against sglang==0.5.23 (the ``serve`` extra pins it; its model API changes between releases) and
imported only by SGLang (see the package docstring). The classes are registered under names stock
SGLang does not know (``OspreyLlamaForCausalLMEagle3``, ``OspreyQwen3ForCausalLMEagle3``), so an export
that needs this plugin fails to load without it instead of serving a half-loaded model, and stock
``LlamaForCausalLMEagle3`` drafts (one-layer EAGLE-3 baselines, third-party drafts) keep SGLang's own code.

Per forward, with ``g`` the fused target features (``fc(aux)``, each aux state RMS-normed first under
``fc_norm``), or the previous draft step's pre-norm hidden (its final norm under ``norm_output``, the
flags stock sglang 0.5.23 reads for the same options), and ``e`` the drafter's embedding: Osprey runs
every layer on ``side = g, stream = e``; EAGLE-3 on ``side = e, stream = g``. A fused layer attends over
``cat(input_layernorm(side), hidden_norm(stream))``, a plain one over ``input_layernorm(stream)``; both
add attention and MLP outputs to the stream. The layers
are driven here, not through their own forward(): SGLang's decoder layers hand the residual and the
tensor-parallel sums to per-layer stage boundaries whose interface moves between releases, so the
attention and the MLP are built to complete their own sums. Names follow megatron_osprey.export.layouts.
"""

from __future__ import annotations

import copy
from typing import Iterable, Tuple

import torch
from sglang.srt.layers.layer_boundary import layer_stack
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import QKVParallelLinear
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models.llama import LlamaDecoderLayer
from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3 as StockLlamaEagle3
from sglang.srt.models.qwen3 import Qwen3DecoderLayer
from sglang.srt.runtime_context import get_parallel, get_spec
from sglang.srt.utils import add_prefix
from torch import nn

from megatron_osprey.export.sglang_plugin.weight_names import layer_kinds, plugin_param_name


def _llama_layer(config, index: int, quant_config, prefix: str) -> nn.Module:
    # stage_boundaries=False: attention and MLP reduce over TP themselves, no boundaries are built.
    return LlamaDecoderLayer(config, index, quant_config=quant_config, prefix=prefix, stage_boundaries=False)


def _qwen3_layer(config, index: int, quant_config, prefix: str) -> nn.Module:
    layer = Qwen3DecoderLayer(config, index, quant_config=quant_config, prefix=prefix)
    # A Qwen3 layer leaves both TP sums to its stage boundaries, which this forward does not use.
    layer.self_attn.o_proj.reduce_results = True
    layer.mlp.down_proj.reduce_results = True
    return layer


def _make_fused(layer: nn.Module, config, quant_config, prefix: str) -> nn.Module:
    """Widen a decoder layer's QKV input to 2H and give it the stream norm."""
    attn = layer.self_attn
    attn.qkv_proj = QKVParallelLinear(
        2 * config.hidden_size,
        attn.head_dim,
        attn.total_num_heads,
        attn.total_num_kv_heads,
        bias=False,
        quant_config=quant_config,
        prefix=add_prefix("qkv_proj", prefix),
    )
    layer.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    return layer


def _layer_forward(layer: nn.Module, fused: bool, positions, side, stream, forward_batch):
    """One layer on the whole stream (pre-norm attention and MLP, both added to the stream)."""
    if fused:
        attn_in = torch.cat([layer.input_layernorm(side), layer.hidden_norm(stream)], dim=-1)
    else:
        attn_in = layer.input_layernorm(stream)
    out = layer.self_attn(positions=positions, hidden_states=attn_in, forward_batch=forward_batch)
    normed, stream = layer.post_attention_layernorm(out, stream)  # fused add: stream + attention
    return stream + layer.mlp(normed)


class OspreyDraftModel(nn.Module):
    """Embedding, fc, fused/plain layers and final norm; returns (hidden for logits, [pre-norm hidden])."""

    def __init__(self, config, make_layer, quant_config=None, prefix: str = ""):
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=add_prefix("embed_tokens", prefix)
        )
        target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
        self.fc = nn.Linear(3 * target_hidden, config.hidden_size, bias=False)
        self.fc_norm = None
        if getattr(config, "fc_norm", None) or getattr(config, "use_aux_norm", False):
            self.fc_norm = nn.ModuleList(RMSNorm(target_hidden, eps=config.rms_norm_eps) for _ in range(3))
        self.norm_output = bool(getattr(config, "norm_output", False))
        self.kinds = layer_kinds(config)
        if make_layer is _qwen3_layer and "plain" in self.kinds:
            raise ValueError(
                "a Qwen3-bodied draft has only fused layers (Osprey); plain layers are EAGLE-3's "
                "Llama layers. Re-export the drafter with tools/export_checkpoint.py."
            )
        layers = []
        with layer_stack():
            for index, kind in enumerate(self.kinds):
                layer_prefix = add_prefix(f"layers.{index}", prefix)
                layer = make_layer(config, index, quant_config, layer_prefix)
                layers.append(_make_fused(layer, config, quant_config, layer_prefix) if kind == "fused" else layer)
        self.layers = nn.ModuleList(layers)
        self.swap_h_and_emb = bool(getattr(config, "swap_h_and_emb", False))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
        embeds = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        g = forward_batch.spec_info.hidden_states
        if g.shape[-1] != embeds.shape[-1]:  # fresh target taps: 3*Ht wide
            if self.fc_norm is not None:
                g = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, g.chunk(3, dim=-1))], dim=-1)
            g = self.fc(g)
        if g.shape[0] == 0:  # idle batch
            return g, [g]
        side, stream = (g, embeds) if self.swap_h_and_emb else (embeds, g)
        for kind, layer in zip(self.kinds, self.layers):
            stream = _layer_forward(layer, kind == "fused", positions, side, stream, forward_batch)
        normed = self.norm(stream)
        return normed, [normed if self.norm_output else stream]


class OspreyLlamaForCausalLMEagle3(StockLlamaEagle3):
    """A draft with Llama layers that stock SGLang cannot serve (Osprey, multi-layer EAGLE-3)."""

    make_layer = staticmethod(_llama_layer)

    def __init__(self, config, quant_config=None, prefix: str = ""):
        nn.Module.__init__(self)
        if getattr(config, "draft_vocab_size", None) is None:
            raise ValueError("an Osprey draft config.json must set draft_vocab_size (tools/export_checkpoint.py does).")
        self.config = config
        self.quant_config = quant_config
        self.pp_group = get_parallel().pp_group
        self._draft_window_size = get_spec().speculative_draft_window_size
        self.model = OspreyDraftModel(config, self.make_layer, quant_config, add_prefix("model", prefix))
        self.load_lm_head_from_target = False
        self.lm_head = ParallelLMHead(
            config.draft_vocab_size, config.hidden_size, quant_config=quant_config, prefix=add_prefix("lm_head", prefix)
        )
        logits_config = copy.deepcopy(config)
        logits_config.vocab_size = config.draft_vocab_size  # the draft head's own vocabulary
        self.logits_processor = LogitsProcessor(logits_config)
        self.capture_aux_hidden_states = True
        self.hot_token_id = None
        self.loaded_own_embedding = False

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Load an exported draft; every tensor must land in a parameter and every parameter be loaded."""
        params = dict(self.named_parameters())
        shards: dict[str, set] = {}
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
            shards.setdefault(param_name, set()).add(shard)
        missing = sorted(set(params) - set(shards))
        if missing:
            raise RuntimeError(
                f"the draft checkpoint has no weights for {missing[:4]} ({len(missing)} parameters); "
                f"re-export it with tools/export_checkpoint.py."
            )
        self.loaded_own_embedding = True

    def set_embed(self, embed):
        """Keep the drafter's own (vocabulary-aligned) embedding instead of the target's."""
        if self.loaded_own_embedding:
            return
        return super().set_embed(embed)

    def get_hot_token_id(self):
        return self.hot_token_id


class OspreyQwen3ForCausalLMEagle3(OspreyLlamaForCausalLMEagle3):
    """The same draft on Qwen3 layers (per-head q/k RMSNorm): Osprey drafters pruned from Qwen3."""

    make_layer = staticmethod(_qwen3_layer)


EntryClass = [OspreyLlamaForCausalLMEagle3, OspreyQwen3ForCausalLMEagle3]
