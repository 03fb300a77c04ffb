"""The Osprey drafter (and the EAGLE-3 baseline) as a Megatron-Core module built from specs.

A drafter layer is Megatron-Core's TransformerLayer with one swapped submodule:
its self-attention (`SideInputSelfAttention`) reads `cat(hidden_norm(side),
input_layernorm(stream))` through a QKV projection of input width 2H, whose
first H columns are W_new and last H columns the pretrained projection. The
variants differ only in what `side` and `stream` are:

* osprey: stream = the drafter's own token embedding, side = g, in every layer;
* eagle3: stream = g (the residual starts from g), side = the target's frozen
  embedding. Its layers are standard Llama-style EAGLE-3 midlayers (no q/k norm,
  whatever the target: `eagle3_body`). With more than one layer, every layer
  reads the embedding again (`eagle3_extra_layers="fused"`, the paper's
  parameter-matched 2-layer baseline and SpecForge's layer stack); `"plain"`
  keeps ordinary decoder layers after the first (SGLang's stock multi-layer draft).

g is `fusion_fc(cat(aux states))` at TTT step 0 and the drafter's own
pre-final-norm output of step k-1 at step k > 0. The training-time-test
attention pattern (queries of step k attend causally to step-0 keys plus the
same-position keys of steps 1..k) is kept by `TTTDotProductAttention`, which
concatenates the cached keys of earlier steps; positions shift by k.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor

from megatron_osprey.base.arch import ModelArch, padded_size
from megatron_osprey.models.gpt import layer_spec, resolve_transformer_impl, transformer_config
from megatron_osprey.parallel import ParallelConfig

VARIANTS = ("osprey", "eagle3")
EAGLE3_EXTRA_LAYERS = ("fused", "plain")


def eagle3_body(target: ModelArch, num_layers: int) -> ModelArch:
    """EAGLE-3's layer body for `target`: Llama-style midlayers as wide as the target, no q/k norm.

    EAGLE-3 drafters (SpecForge, SGLang's LlamaForCausalLMEagle3, speculators' Eagle3Speculator) are
    Llama layers whatever the target; a Qwen3 target's q/k norms would be dropped by stock loaders.
    A mixture-of-experts target gives a dense layer of its config's `mlp_intermediate_size`.
    """
    if num_layers < 1:
        raise ValueError(f"--eagle3-num-layers must be >= 1, got {num_layers}.")
    ffn = target.ffn_hidden_size
    if target.is_moe:
        ffn = target.hf_config.get("mlp_intermediate_size")
        if not ffn:
            raise ValueError(
                "--baseline eagle3 on a mixture-of-experts target needs a dense layer width: its config.json "
                "has no mlp_intermediate_size."
            )
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": target.hidden_size,
        "intermediate_size": int(ffn),
        "num_hidden_layers": num_layers,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_query_groups,
        "head_dim": target.head_dim,
        "vocab_size": target.vocab_size,
        "max_position_embeddings": target.max_position_embeddings,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "rope_scaling": None if target.rope_scaling is None else {"rope_type": "llama3", **target.rope_scaling},
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": target.torch_dtype,
        "initializer_range": float(target.hf_config.get("initializer_range", 0.02)),
    }
    return ModelArch.from_hf_config(config, source="the EAGLE-3 layer config")


@dataclass(frozen=True)
class DrafterArch:
    """Shape of a drafter: a backbone body, the target's sizes, the draft vocabulary and the variant."""

    body: ModelArch  # the backbone's layers (num_layers = drafter layers)
    target_hidden_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    variant: str = "osprey"
    eagle3_extra_layers: str = "fused"  # EAGLE-3 layers after the first: fused (paper) or plain

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"drafter variant must be one of {VARIANTS}, got {self.variant!r}.")
        if self.eagle3_extra_layers not in EAGLE3_EXTRA_LAYERS:
            raise ValueError(
                f"--eagle3-extra-layers must be one of {EAGLE3_EXTRA_LAYERS}, got {self.eagle3_extra_layers!r}."
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"--draft-vocab-size {self.draft_vocab_size} must be in 1..{self.vocab_size} (the target vocabulary)."
            )

    @property
    def hidden_size(self) -> int:
        return self.body.hidden_size

    def layer_is_fused(self, index: int) -> bool:
        """Whether layer `index` reads cat(side, stream) (width 2H) or only its stream."""
        return self.variant == "osprey" or index == 0 or self.eagle3_extra_layers == "fused"

    def to_dict(self) -> dict:
        return {
            "body_hf_config": self.body.hf_config | {"num_hidden_layers": self.body.num_layers},
            "target_hidden_size": self.target_hidden_size,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "aux_layer_ids": list(self.aux_layer_ids),
            "variant": self.variant,
            "eagle3_extra_layers": self.eagle3_extra_layers,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "DrafterArch":
        return cls(
            body=ModelArch.from_hf_config(data["body_hf_config"]),
            target_hidden_size=int(data["target_hidden_size"]),
            vocab_size=int(data["vocab_size"]),
            draft_vocab_size=int(data["draft_vocab_size"]),
            aux_layer_ids=tuple(data["aux_layer_ids"]),
            variant=data["variant"],
            # Drafters saved before the field existed had plain extra layers.
            eagle3_extra_layers=data.get("eagle3_extra_layers", "plain"),
        )

    def reference_config(self):
        """The plain-PyTorch reference drafter's config for the same drafter."""
        from megatron_osprey.models.reference_drafter import DrafterConfig

        body = self.body
        return DrafterConfig(
            hidden_size=body.hidden_size,
            target_hidden_size=self.target_hidden_size,
            num_layers=body.num_layers,
            num_attention_heads=body.num_attention_heads,
            num_key_value_heads=body.num_query_groups,
            head_dim=body.head_dim,
            intermediate_size=body.ffn_hidden_size,
            vocab_size=self.vocab_size,
            draft_vocab_size=self.draft_vocab_size,
            rms_norm_eps=body.rms_norm_eps,
            rope_theta=body.rope_theta,
            rope_scaling=None if body.rope_scaling is None else {"rope_type": "llama3", **body.rope_scaling},
            qk_layernorm=body.qk_layernorm,
            aux_layer_ids=list(self.aux_layer_ids),
            tie_word_embeddings=False,
            variant=self.variant,
            eagle3_extra_layers=self.eagle3_extra_layers,
        )


# ----------------------------------------------------------------------------- attention


@dataclass
class TTTCache:
    """Keys/values of earlier TTT steps for one attention module, [s, b, groups, head_dim] each."""

    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)


def ttt_attention_mask(seq_length: int, step: int, device=None) -> Tensor:
    """[1, 1, s, (step+1)*s], True = masked: causal over step-0 keys, the diagonal of steps 1..step."""
    causal = torch.ones(seq_length, seq_length, dtype=torch.bool, device=device).triu(1)
    diagonal = ~torch.eye(seq_length, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)[None, None]


def _core_attention_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class TTTDotProductAttention(DotProductAttention):
        """Unfused attention that, inside a TTT unroll, also attends to earlier steps' cached keys."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
            cache: TTTCache | None = getattr(self, "ttt_cache", None)
            step = 0 if cache is None else len(cache.keys)
            if cache is not None and step:
                all_keys = torch.cat(cache.keys + [key], dim=0)
                all_values = torch.cat(cache.values + [value], dim=0)
            else:
                all_keys, all_values = key, value
            mask = ttt_attention_mask(query.shape[0], step, query.device)
            if cache is not None:
                cache.keys.append(key)
                cache.values.append(value)
            return super().forward(query, all_keys, all_values, mask, AttnMaskType.arbitrary, attention_bias, packed_seq_params)

    return TTTDotProductAttention


def _side_input_attention_classes():
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import build_module

    @dataclass
    class SideInputSelfAttentionSubmodules(SelfAttentionSubmodules):
        hidden_norm: object = None

    class SideInputSelfAttention(SelfAttention):
        """Self-attention whose QKV reads cat(hidden_norm(side), input_layernorm(stream)), width 2H."""

        def __init__(self, config, submodules, layer_number, **kwargs):
            super().__init__(config, submodules, layer_number, **kwargs)
            # Rebuilt with input width 2H: columns [:H] read the side input (W_new), [H:] the stream.
            self.linear_qkv = submodules.linear_qkv(
                2 * self.config.hidden_size,
                self.linear_qkv_out_dim,
                config=self.config,
                init_method=self.config.init_method,
                gather_output=False,
                bias=self.config.add_bias_linear or self.config.add_qkv_bias,
                skip_bias_add=False,
                is_expert=False,
                tp_comm_buffer_name="qkv",
                tp_group=self.pg_collection.tp,
            )
            self.hidden_norm = build_module(
                submodules.hidden_norm, config=self.config, hidden_size=self.config.hidden_size,
                eps=self.config.layernorm_epsilon,
            )
            self.side_input: Tensor | None = None

        def get_query_key_value_tensors(self, hidden_states, key_value_states=None, *args, **kwargs):
            if self.side_input is None:
                raise RuntimeError("SideInputSelfAttention needs its side input; call it through the drafter model.")
            fused = torch.cat([self.hidden_norm(self.side_input), hidden_states], dim=-1)
            return super().get_query_key_value_tensors(fused, key_value_states, *args, **kwargs)

    return SideInputSelfAttentionSubmodules, SideInputSelfAttention


def drafter_layer_specs(arch: DrafterArch, transformer_impl: str) -> list:
    """One ModuleSpec per drafter layer: the backbone's layer spec with the attention swapped."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec

    base = layer_spec(arch.body, "local")
    submodules = base.submodules
    attention = submodules.self_attention
    norm = submodules.input_layernorm
    linear_qkv = attention.submodules.linear_qkv
    linear_proj = attention.submodules.linear_proj
    if transformer_impl == "transformer_engine":
        # TE linears without the fused norm (the two halves need their own norms); the
        # attention core stays the unfused TTT-aware one, which takes arbitrary masks.
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm, TERowParallelLinear

        linear_qkv, linear_proj, norm = TEColumnParallelLinear, TERowParallelLinear, TENorm
    side_submodules_cls, side_attention_cls = _side_input_attention_classes()
    core = _core_attention_class()

    def attention_spec(fused: bool):
        if fused:
            sub = side_submodules_cls(
                linear_qkv=linear_qkv, core_attention=core, linear_proj=linear_proj,
                q_layernorm=attention.submodules.q_layernorm, k_layernorm=attention.submodules.k_layernorm,
                hidden_norm=norm,
            )
            return ModuleSpec(module=side_attention_cls, params={"attn_mask_type": AttnMaskType.arbitrary}, submodules=sub)
        sub = dataclasses.replace(attention.submodules, linear_qkv=linear_qkv, linear_proj=linear_proj, core_attention=core)
        return ModuleSpec(module=attention.module, params={"attn_mask_type": AttnMaskType.arbitrary}, submodules=sub)

    specs = []
    for index in range(arch.body.num_layers):
        fused = arch.layer_is_fused(index)
        layer_sub = dataclasses.replace(
            submodules, input_layernorm=norm, pre_mlp_layernorm=norm, self_attention=attention_spec(fused)
        )
        if transformer_impl == "transformer_engine":
            mlp = layer_sub.mlp
            from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

            layer_sub = dataclasses.replace(
                layer_sub,
                mlp=dataclasses.replace(mlp, submodules=dataclasses.replace(
                    mlp.submodules, linear_fc1=TEColumnParallelLinear, linear_fc2=TERowParallelLinear)),
            )
        specs.append(ModuleSpec(module=base.module, submodules=layer_sub))
    return specs


# ----------------------------------------------------------------------------- model


def _drafter_model_class():
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    class OspreyDrafterModel(MegatronModule):
        """Embedding + fusion_fc + drafter layers + final norm + draft-vocab LM head."""

        def __init__(self, config, arch: DrafterArch, transformer_impl: str):
            super().__init__(config=config)
            from megatron.core.enums import ModelType

            self.model_type = ModelType.encoder_or_decoder  # what Megatron's schedules look for
            self.arch = arch
            self.transformer_impl = transformer_impl
            tp = config.tensor_model_parallel_size
            self.embedding = LanguageModelEmbedding(
                config=config, vocab_size=padded_size(arch.vocab_size, tp),
                max_sequence_length=arch.body.max_position_embeddings, position_embedding_type="none",
            )
            if arch.variant == "eagle3":  # EAGLE-3 reads the target's frozen embedding
                self.embedding.word_embeddings.weight.requires_grad_(False)
            self.fusion_fc = torch.nn.Linear(3 * arch.target_hidden_size, arch.hidden_size, bias=False,
                                             dtype=config.params_dtype)
            self.rotary_pos_emb = RotaryEmbedding(
                kv_channels=config.kv_channels, rotary_percent=1.0, rotary_base=int(arch.body.rope_theta),
                use_cpu_initialization=config.use_cpu_initialization,
            )
            self.rotary_pos_emb.inv_freq = arch.body.rotary_inv_freq().to(self.rotary_pos_emb.inv_freq.device)
            specs = drafter_layer_specs(arch, transformer_impl)
            self.decoder = TransformerBlock(
                config=config, spec=TransformerBlockSubmodules(layer_specs=specs), post_layer_norm=False,
                pre_process=True, post_process=False,
            )
            norm = specs[0].submodules.input_layernorm
            self.final_layernorm = build_module(norm, config=config, hidden_size=arch.hidden_size,
                                                eps=config.layernorm_epsilon)
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                arch.hidden_size, padded_size(arch.draft_vocab_size, tp), config=config,
                init_method=config.init_method, bias=False, gather_output=False,
            )
            self.register_buffer("d2t", torch.zeros(arch.draft_vocab_size, dtype=torch.int64))
            t2d = torch.zeros(arch.vocab_size, dtype=torch.bool)
            t2d[: arch.draft_vocab_size] = True
            self.register_buffer("t2d", t2d)

        def set_input_tensor(self, input_tensor) -> None:
            self.decoder.set_input_tensor(input_tensor)

        def side_attentions(self):
            return [layer.self_attention for layer in self.decoder.layers if hasattr(layer.self_attention, "hidden_norm")]

        def core_attentions(self):
            return [layer.self_attention.core_attention for layer in self.decoder.layers]

        def fuse_aux(self, aux_hidden: Tensor) -> Tensor:
            """g = fusion_fc(cat(aux)) for aux [b, s, 3*Ht]; returned [s(/tp under SP), b, H]."""
            g = self.fusion_fc(aux_hidden).transpose(0, 1).contiguous()
            if self.config.sequence_parallel:
                g = tensor_parallel.scatter_to_sequence_parallel_region(g)
            return g

        def forward(self, input_ids: Tensor, aux_hidden: Tensor | None = None, g: Tensor | None = None, step: int = 0):
            """(logits [b, s, Vd/TP], pre-norm hidden [s(/TP), b, H]) for one pass at position offset `step`."""
            if (aux_hidden is None) == (g is None):
                raise ValueError("the drafter needs exactly one of aux_hidden (step 0) or g (later TTT steps).")
            if g is None:
                g = self.fuse_aux(aux_hidden)
            seq = input_ids.shape[1]
            positions = torch.arange(seq, device=input_ids.device).expand_as(input_ids)
            emb = self.embedding(input_ids=input_ids, position_ids=positions)
            stream, side = (emb, g) if self.arch.variant == "osprey" else (g, emb)
            rotary = self.rotary_pos_emb(seq + step)[step:]
            for attention in self.side_attentions():
                attention.side_input = side
            try:
                hidden = self.decoder(hidden_states=stream, attention_mask=None, rotary_pos_emb=rotary)
            finally:
                for attention in self.side_attentions():
                    attention.side_input = None
            logits, _ = self.output_layer(self.final_layernorm(hidden))
            return logits.transpose(0, 1).contiguous(), hidden

        @contextlib.contextmanager
        def ttt_unroll(self):
            """Within this context, successive forwards are TTT steps 0, 1, ... sharing cached keys."""
            cores = self.core_attentions()
            for core in cores:
                core.ttt_cache = TTTCache()
            try:
                yield
            finally:
                for core in cores:
                    core.ttt_cache = None

        def ttt_forward(self, input_ids: Tensor, aux_hidden: Tensor, steps: int):
            """Per-step logits (and pre-norm hiddens) of a K-step training-time-test unroll.

            Step k reads input_ids shifted left by k (zero-padded), positions + k and
            g = step k-1's pre-norm output; rows t >= s-k are padding for the loss.
            """
            logits_per_step, hidden_per_step = [], []
            g = None
            with self.ttt_unroll():
                for k in range(steps):
                    ids_k = torch.nn.functional.pad(input_ids[:, k:], (0, min(k, input_ids.shape[1])))
                    if k == 0:
                        logits, hidden = self(ids_k, aux_hidden=aux_hidden, step=0)
                    else:
                        logits, hidden = self(ids_k, g=g, step=k)
                    logits_per_step.append(logits)
                    hidden_per_step.append(hidden)
                    g = hidden
            return logits_per_step, hidden_per_step

    return OspreyDrafterModel


def build_drafter_model(
    arch: DrafterArch,
    parallel: ParallelConfig,
    *,
    transformer_impl: str = "auto",
    params_dtype: torch.dtype | None = None,
    perform_initialization: bool = True,
    **config_overrides,
):
    """Build the Megatron-Core drafter (needs initialized model-parallel state; PP must be 1)."""
    if parallel.pipeline_model_parallel_size != 1:
        raise ValueError(
            "the drafter has a few layers and is not pipelined: use --pipeline-model-parallel-size 1 "
            "for it (the target may still be pipelined)."
        )
    impl = resolve_transformer_impl(transformer_impl)
    config = transformer_config(
        arch.body, parallel, params_dtype=params_dtype, perform_initialization=perform_initialization,
        **config_overrides,
    )
    return _drafter_model_class()(config, arch, impl)
