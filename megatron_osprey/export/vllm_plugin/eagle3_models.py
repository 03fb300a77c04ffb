"""vLLM draft classes for the drafters whose computation stock ``Eagle3LlamaForCausalLM`` does not match.

Stock vLLM 0.32 runs one fused EAGLE-3 layer, ``cat(input_layernorm(e), hidden_norm(g))`` with the
residual stream starting from g, then plain layers. An Osprey drafter fuses in every layer and keeps its
own embedding e as the residual stream with g as the side input; a ``fused`` multi-layer EAGLE-3 drafter
fuses in every layer; a q/k-norm (Qwen3) body needs Qwen3 attention everywhere. Per forward, with g the
fused target features (``fc(cat(aux))``, each aux state RMS-normed first under ``fc_norm``) or the previous
draft step's pre-norm hidden (its final norm under ``norm_output``), each layer reads what its
``draft_layer_kinds`` entry says (weight_names), adds attention and MLP outputs to the stream, and the
final norm feeds the head. Written against vLLM 0.32; imported only inside vLLM (see the package
docstring). The layers are vLLM's own (Llama / Qwen3 EAGLE-3 decoder layers, attention, MLP); only the
wiring between them is this module's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.model_executor.models.llama_eagle3 import LlamaDecoderLayer as Eagle3LlamaDecoderLayer
from vllm.model_executor.models.qwen3_eagle3 import Qwen3Eagle3DecoderLayer
from vllm.model_executor.models.utils import get_draft_quant_config, maybe_prefix, process_eagle_weight

from megatron_osprey.export.vllm_plugin.weight_names import layer_kinds, vllm_param_name

NUM_AUX_STATES = 3


def _decoder_layer(layer_cls, vllm_config: VllmConfig, config, kind: str, prefix: str) -> nn.Module:
    """vLLM's EAGLE-3 decoder layer: 2H-wide QKV and hidden_norm for a fused kind, a plain layer otherwise."""
    layer = layer_cls(vllm_config, prefix=prefix, config=config, layer_idx=0 if kind != "plain" else 1)
    if kind == "plain":
        del layer.hidden_norm  # a plain layer has no side input
    return layer


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "hidden_states": 0, "input_embeds": 0})
class OspreyDraftModel(nn.Module):
    """Embedding, fc (with the attributes Eagle3LlamaForCausalLM.combine_hidden_states reads), layers, norm."""

    def __init__(
        self, *, vllm_config: VllmConfig, layer_cls=Eagle3LlamaDecoderLayer, start_layer_id: int = 0, prefix: str = ""
    ) -> None:
        super().__init__()
        config = vllm_config.speculative_config.draft_model_config.hf_config
        self.config = config
        self.kinds = layer_kinds(config)
        self.osprey = self.kinds[0] == "osprey"
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "embed_tokens")
        )
        current = get_current_vllm_config()
        self.layers = nn.ModuleList(
            _decoder_layer(layer_cls, current, config, kind, maybe_prefix(prefix, f"layers.{index + start_layer_id}"))
            for index, kind in enumerate(self.kinds)
        )
        target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
        self.use_aux_hidden_state = True
        self.norm_before_fc = False
        self.input_norm = None
        self.num_aux_hidden_states = NUM_AUX_STATES
        self.fc_input_size = NUM_AUX_STATES * target_hidden
        self.fc_norm = None
        if getattr(config, "fc_norm", False):
            self.fc_norm = nn.ModuleList(RMSNorm(target_hidden, eps=config.rms_norm_eps) for _ in range(NUM_AUX_STATES))
        self.fc = ReplicatedLinear(
            self.fc_input_size,
            config.hidden_size,
            bias=False,
            params_dtype=vllm_config.model_config.dtype,
            quant_config=get_draft_quant_config(vllm_config),
            prefix=maybe_prefix(prefix, "fc"),
            return_bias=False,
        )
        self.norm_output = bool(getattr(config, "norm_output", False))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        input_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.embed_input_ids(input_ids) if input_embeds is None else input_embeds
        stream, side = (embeds, hidden_states) if self.osprey else (hidden_states, embeds)
        for kind, layer in zip(self.kinds, self.layers):
            if kind == "osprey":
                attn_in = torch.cat([layer.hidden_norm(side), layer.input_layernorm(stream)], dim=-1)
            elif kind == "eagle3":
                attn_in = torch.cat([layer.input_layernorm(side), layer.hidden_norm(stream)], dim=-1)
            else:
                attn_in = layer.input_layernorm(stream)
            # Out of place: the stream may be the proposer's hidden-state buffer or the side input's source.
            stream = stream + layer.self_attn(positions=positions, hidden_states=attn_in)
            stream = stream + layer.mlp(layer.post_attention_layernorm(stream))
        normed = self.norm(stream)
        return normed, (normed if self.norm_output else stream)


class Eagle3OspreyLlamaForCausalLM(Eagle3LlamaForCausalLM):
    """A draft on Llama layers that stock vLLM cannot serve (Osprey, fused multi-layer EAGLE-3)."""

    layer_cls = Eagle3LlamaDecoderLayer

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)
        speculative_config = vllm_config.speculative_config
        self.config = config = speculative_config.draft_model_config.hf_config
        if getattr(config, "draft_vocab_size", None) is None:
            config.draft_vocab_size = config.vocab_size
        target_layers = vllm_config.model_config.get_total_num_hidden_layers()
        config.target_layer_count = target_layers
        self.model = OspreyDraftModel(
            vllm_config=vllm_config,
            layer_cls=self.layer_cls,
            start_layer_id=target_layers,  # attention layer names after the target's
            prefix=maybe_prefix(prefix, "model"),
        )
        self.lm_head = ParallelLMHead(
            config.draft_vocab_size,
            config.hidden_size,
            quant_config=get_draft_quant_config(vllm_config),
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        self.logits_processor = LogitsProcessor(config.draft_vocab_size, scale=getattr(config, "logit_scale", 1.0))
        self.draft_id_to_target_id = None
        if config.draft_vocab_size != vllm_config.model_config.get_vocab_size():
            self.draft_id_to_target_id = nn.Parameter(
                torch.zeros(config.draft_vocab_size, dtype=torch.long), requires_grad=False
            )
        self.use_parallel_drafting = speculative_config.parallel_drafting
        if self.use_parallel_drafting:
            raise ValueError("the megatron_osprey vLLM plugin does not support parallel drafting.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Every exported tensor lands in a parameter and every parameter is loaded, or this raises."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            mapped = vllm_param_name(name)
            if mapped is None:
                continue
            param_name, shard = mapped
            if param_name == "draft_id_to_target_id" and self.draft_id_to_target_id is None:
                continue  # draft vocabulary == target vocabulary: the offsets are all zero
            if param_name not in params:
                raise KeyError(f"draft checkpoint tensor {name!r} maps to {param_name!r}, which this model lacks.")
            param = params[param_name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor) if shard is None else loader(param, tensor, shard)
            process_eagle_weight(self, name)
            loaded.add(param_name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise RuntimeError(
                f"the draft checkpoint has no weights for {missing[:4]} ({len(missing)} parameters); "
                f"re-export it with `osprey export --format vllm`."
            )
        return loaded


class Eagle3OspreyQwen3ForCausalLM(Eagle3OspreyLlamaForCausalLM):
    """The same draft on Qwen3 layers (per-head q/k RMSNorm)."""

    layer_cls = Qwen3Eagle3DecoderLayer
