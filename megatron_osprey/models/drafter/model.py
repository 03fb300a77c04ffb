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
pre-final-norm output of step k-1 at step k > 0. Against attention drift (both
off by default): `hidden_post_norm` passes `final_layernorm(output)` to the
next step instead, and `aux_hidden_norm` RMS-normalizes each captured target
state (`aux_norms`) before `fusion_fc`. The training-time-test
attention pattern (queries of step k attend causally to step-0 keys plus the
same-position keys of steps 1..k) is computed by `TTTCoreAttention` in memory
linear in the sequence (`models.ttt_attention`); positions shift by k.

Per-pass inputs (the side input, the earlier steps' keys and values) travel as
forward arguments: Megatron-Core's TransformerBlock hands its `attention_mask`
argument unchanged to every self-attention and core attention, and the drafter's
attention pattern is structural (it takes no mask), so a `DrafterAttentionInputs`
travels in that slot. Nothing is set on a module around a call.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from torch import Tensor

from megatron_osprey.base.arch import padded_size
from megatron_osprey.models.backbone.gpt import (
    layer_spec,
    resolve_transformer_impl,
    rotary_inv_freq,
    transformer_config,
)
from megatron_osprey.models.backbone.specs import replace_spec_submodules, spec_submodules
from megatron_osprey.models.drafter.arch import (  # noqa: F401  (re-exported: the drafter's public names)
    EAGLE3_EXTRA_LAYERS,
    VARIANTS,
    DrafterArch,
    eagle3_body,
)
from megatron_osprey.models.drafter.ttt_attention import ttt_attention
from megatron_osprey.parallel import ParallelConfig

# ----------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class DrafterAttentionInputs:
    """What one drafter pass hands each attention: the side input and the TTT keys/values.

    past: one {layer_number: (key, value)} per earlier TTT step, step 0 first, keys
    [s, b, groups, head_dim]. new: filled with this pass's {layer_number: (key, value)}
    (assigned by layer number, so a recomputed forward overwrites rather than appends).
    """

    side: Tensor | None = None
    past: tuple = ()
    new: dict | None = None


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, valid under sequence parallelism (Megatron-Core's WrappedTorchNorm asserts it off).

    Under SP the norm's input is this rank's sequence shard, so the weight gradient is
    partial: the `sequence_parallel` tag makes finalize_model_grads all-reduce it over TP.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(normalized_shape=hidden_size, eps=eps)
        if config.sequence_parallel:
            setattr(self.weight, "sequence_parallel", True)


class TTTCoreAttention(MegatronModule):
    """Core attention for the drafter: causal over step-0 keys plus the same-position keys of steps 1..k."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        tp = config.tensor_model_parallel_size
        self.layer_number = max(1, layer_number)
        self.heads_per_partition = config.num_attention_heads // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else self.head_dim**-0.5

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        """query [s, b, heads, d], key/value [s, b, groups, d] -> [s, b, heads * d]."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("the drafter's TTT attention takes neither an attention bias nor packed sequences.")
        if attention_mask is not None and not isinstance(attention_mask, DrafterAttentionInputs):
            raise ValueError("the drafter's TTT attention takes no mask; call it through the drafter model.")
        inputs = attention_mask or DrafterAttentionInputs()
        if inputs.new is not None:
            inputs.new[self.layer_number] = (key, value)
        keys = [step[self.layer_number][0] for step in inputs.past] + [key]
        values = [step[self.layer_number][1] for step in inputs.past] + [value]
        to_bhsd = lambda x: x.permute(1, 2, 0, 3)  # noqa: E731
        out = ttt_attention(
            to_bhsd(query), [to_bhsd(k) for k in keys], [to_bhsd(v) for v in values], self.softmax_scale
        )
        s, b = query.shape[:2]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_partition * self.head_dim)


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
            submodules.hidden_norm,
            config=self.config,
            hidden_size=self.config.hidden_size,
            eps=self.config.layernorm_epsilon,
        )

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        if not isinstance(attention_mask, DrafterAttentionInputs) or attention_mask.side is None:
            raise RuntimeError("SideInputSelfAttention needs its side input; call it through the drafter model.")
        fused = torch.cat([self.hidden_norm(attention_mask.side), hidden_states], dim=-1)
        return super().forward(fused, attention_mask, *args, **kwargs)


def _drafter_submodules(arch: DrafterArch, transformer_impl: str):
    """(backbone layer submodules, linear_qkv, linear_proj, norm, fc1, fc2) for the drafter's impl."""
    base = layer_spec(arch.body, "local")
    submodules = base.submodules
    attention = submodules.self_attention.submodules
    mlp = spec_submodules(submodules.mlp)
    if transformer_impl == "transformer_engine":
        # TE linears without the fused norm (the two halves need their own norms).
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm, TERowParallelLinear

        return base, TEColumnParallelLinear, TERowParallelLinear, TENorm, TEColumnParallelLinear, TERowParallelLinear
    return base, attention.linear_qkv, attention.linear_proj, SequenceParallelRMSNorm, mlp.linear_fc1, mlp.linear_fc2


def _qk_norm(spec):
    """The backbone's q/k norm, as an SP-valid torch norm where it was Megatron's WrappedTorchNorm."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return SequenceParallelRMSNorm if spec is WrappedTorchNorm else spec


def drafter_layer_specs(arch: DrafterArch, transformer_impl: str) -> list:
    """One ModuleSpec per drafter layer: the backbone's layer spec with the attention swapped."""
    base, linear_qkv, linear_proj, norm, fc1, fc2 = _drafter_submodules(arch, transformer_impl)
    submodules = base.submodules
    attention = submodules.self_attention
    common = dict(
        linear_qkv=linear_qkv,
        core_attention=TTTCoreAttention,
        linear_proj=linear_proj,
        q_layernorm=_qk_norm(attention.submodules.q_layernorm),
        k_layernorm=_qk_norm(attention.submodules.k_layernorm),
    )
    fused_spec = ModuleSpec(
        module=SideInputSelfAttention,
        params={"attn_mask_type": AttnMaskType.arbitrary},
        submodules=SideInputSelfAttentionSubmodules(**common, hidden_norm=norm),
    )
    plain_spec = ModuleSpec(
        module=attention.module,
        params={"attn_mask_type": AttnMaskType.arbitrary},
        submodules=dataclasses.replace(attention.submodules, **common),
    )
    mlp = replace_spec_submodules(submodules.mlp, linear_fc1=fc1, linear_fc2=fc2)
    specs = []
    for index in range(arch.body.num_layers):
        fused = arch.layer_is_fused(index)
        layer_sub = dataclasses.replace(
            submodules,
            input_layernorm=norm,
            pre_mlp_layernorm=norm,
            mlp=mlp,
            self_attention=fused_spec if fused else plain_spec,
        )
        specs.append(ModuleSpec(module=base.module, submodules=layer_sub))
    return specs


# ----------------------------------------------------------------------------- model


class OspreyDrafterModel(MegatronModule):
    """Embedding + fusion_fc + drafter layers + final norm + draft-vocab LM head."""

    def __init__(self, config, arch: DrafterArch, transformer_impl: str):
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder  # what Megatron's schedules look for
        self.arch = arch
        self.transformer_impl = transformer_impl
        tp = config.tensor_model_parallel_size
        self.embedding = LanguageModelEmbedding(
            config=config,
            vocab_size=padded_size(arch.vocab_size, tp),
            max_sequence_length=arch.body.max_position_embeddings,
            position_embedding_type="none",
        )
        if arch.variant == "eagle3":  # EAGLE-3 reads the target's frozen embedding
            self.embedding.word_embeddings.weight.requires_grad_(False)
        self.fusion_fc = torch.nn.Linear(
            3 * arch.target_hidden_size, arch.hidden_size, bias=False, dtype=config.params_dtype
        )
        if arch.aux_hidden_norm:
            # Applied before the sequence is split for SP, like fusion_fc: plain replicated norms.
            self.aux_norms = torch.nn.ModuleList(
                torch.nn.RMSNorm(arch.target_hidden_size, eps=config.layernorm_epsilon, dtype=config.params_dtype)
                for _ in range(3)
            )
        self.rotary_pos_emb = RotaryEmbedding(
            kv_channels=config.kv_channels,
            rotary_percent=1.0,
            rotary_base=int(arch.body.rope_theta),
            use_cpu_initialization=config.use_cpu_initialization,
        )
        self.rotary_pos_emb.inv_freq = rotary_inv_freq(arch.body).to(self.rotary_pos_emb.inv_freq.device)
        specs = drafter_layer_specs(arch, transformer_impl)
        self.decoder = TransformerBlock(
            config=config,
            spec=TransformerBlockSubmodules(layer_specs=specs),
            post_layer_norm=False,
            pre_process=True,
            post_process=False,
        )
        norm = specs[0].submodules.input_layernorm
        self.final_layernorm = build_module(
            norm, config=config, hidden_size=arch.hidden_size, eps=config.layernorm_epsilon
        )
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            arch.hidden_size,
            padded_size(arch.draft_vocab_size, tp),
            config=config,
            init_method=config.init_method,
            bias=False,
            gather_output=False,
        )
        self.register_buffer("d2t", torch.zeros(arch.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(arch.vocab_size, dtype=torch.bool)
        t2d[: arch.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    def set_input_tensor(self, input_tensor) -> None:
        self.decoder.set_input_tensor(input_tensor)

    def fuse_aux(self, aux_hidden: Tensor) -> Tensor:
        """g = fusion_fc(cat(aux)) for aux [b, s, 3*Ht]; returned [s(/tp under SP), b, H]."""
        if self.arch.aux_hidden_norm:
            chunks = aux_hidden.chunk(3, dim=-1)
            aux_hidden = torch.cat([norm(chunk) for norm, chunk in zip(self.aux_norms, chunks)], dim=-1)
        g = self.fusion_fc(aux_hidden).transpose(0, 1).contiguous()
        if self.config.sequence_parallel:
            g = tensor_parallel.scatter_to_sequence_parallel_region(g)
        return g

    def forward(
        self,
        input_ids: Tensor,
        aux_hidden: Tensor | None = None,
        g: Tensor | None = None,
        step: int = 0,
        ttt_past: tuple = (),
        ttt_new: dict | None = None,
        rows: Tensor | None = None,
    ):
        """(logits [b, s, Vd/TP], pre-norm hidden [s(/TP), b, H]) for one pass at position offset `step`.

        ttt_past: the {layer_number: (key, value)} of earlier TTT steps (step 0 first);
        ttt_new, when given, receives this pass's keys and values.
        rows [b, s] bool, when given: logits of those rows only, [n, Vd/TP] in (b, s) order. The LM head
        is most of a small drafter's cost, and a TTT step needs logits only where its loss counts.
        """
        if (aux_hidden is None) == (g is None):
            raise ValueError("the drafter needs exactly one of aux_hidden (step 0) or g (later TTT steps).")
        if g is None:
            g = self.fuse_aux(aux_hidden)
        seq = input_ids.shape[1]
        positions = torch.arange(seq, device=input_ids.device).expand_as(input_ids)
        emb = self.embedding(input_ids=input_ids, position_ids=positions)
        stream, side = (emb, g) if self.arch.variant == "osprey" else (g, emb)
        rotary = self.rotary_pos_emb(seq + step)[step:]
        inputs = DrafterAttentionInputs(side=side, past=tuple(ttt_past), new=ttt_new)
        hidden = self.decoder(hidden_states=stream, attention_mask=inputs, rotary_pos_emb=rotary)
        normed = self.final_layernorm(hidden)
        if rows is not None and not self.config.sequence_parallel:
            # Row-wise ops (norm, head) on the selected rows equal the same rows of the full pass.
            selected = normed.transpose(0, 1)[rows]
            logits, _ = self.output_layer(selected[:, None])
            return logits[:, 0], hidden
        logits, _ = self.output_layer(normed)
        logits = logits.transpose(0, 1).contiguous()
        # Under sequence parallelism the head's input is sequence-sharded: select after the gather.
        return (logits if rows is None else logits[rows]), hidden

    def ttt_forward(
        self,
        input_ids: Tensor,
        aux_hidden: Tensor,
        steps: int,
        rows: list[Tensor] | None = None,
        step_ids: list[Tensor] | None = None,
    ):
        """Per-step logits (and pre-norm hiddens) of a K-step training-time-test unroll.

        Step k reads input_ids shifted left by k (zero-padded), positions + k and
        g = step k-1's pre-norm output (final-normed under hidden_post_norm); rows t >= s-k are padding for the loss.
        rows[k] [b, s] bool, when given: step k's logits for those rows only ([n_k, Vd/TP]).
        step_ids[k] [b, s], when given, are step k's input ids instead (on-policy: a row reads its own drafts).
        """
        logits_per_step, hidden_per_step, past = [], [], ()
        g = None
        for k in range(steps):
            ids_k = torch.nn.functional.pad(input_ids[:, k:], (0, min(k, input_ids.shape[1])))
            ids_k = ids_k if step_ids is None else step_ids[k]
            new: dict = {}
            rows_k = None if rows is None else rows[k]
            if k == 0:
                logits, hidden = self(ids_k, aux_hidden=aux_hidden, step=0, ttt_past=past, ttt_new=new, rows=rows_k)
            else:
                logits, hidden = self(ids_k, g=g, step=k, ttt_past=past, ttt_new=new, rows=rows_k)
            past = past + (new,)
            logits_per_step.append(logits)
            hidden_per_step.append(hidden)
            g = self.final_layernorm(hidden) if self.arch.hidden_post_norm else hidden
        return logits_per_step, hidden_per_step


def build_drafter_model(
    arch: DrafterArch,
    parallel: ParallelConfig,
    *,
    transformer_impl: str = "auto",
    params_dtype: torch.dtype | None = None,
    perform_initialization: bool = True,
    **config_overrides,
):
    """Build the Megatron-Core drafter (needs initialized model-parallel state; PP and CP must be 1).

    The drafter is dense: inside a job laid out for a mixture-of-experts target it is built with the job's
    dense layout (expert parallel size 1), replicated over the expert-parallel ranks.
    """
    parallel = parallel.dense_layout()
    if parallel.pipeline_model_parallel_size != 1:
        raise ValueError(
            "the drafter has a few layers and is not pipelined: use --pipeline-model-parallel-size 1 "
            "for it (the target may still be pipelined)."
        )
    if parallel.context_parallel_size != 1:
        raise ValueError(
            f"--context-parallel-size {parallel.context_parallel_size}: the drafter's TTT attention is not "
            "context-parallel; use --context-parallel-size 1 for distillation."
        )
    if config_overrides.get("recompute_granularity") is not None:
        raise ValueError("the drafter does not support activation recompute; leave --recompute-granularity unset.")
    impl = resolve_transformer_impl(transformer_impl)
    config = transformer_config(
        arch.body,
        parallel,
        params_dtype=params_dtype,
        perform_initialization=perform_initialization,
        **config_overrides,
    )
    return OspreyDrafterModel(config, arch, impl)
