"""A drafter's shape (`DrafterArch`, the EAGLE-3 body) free of Megatron-Core.

Kept apart from the Megatron modules in `models.drafter` so that the converters, the
stages and the speculative engine read a drafter's shape without importing Megatron-Core.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_osprey.base.arch import ModelArch, padded_size
from megatron_osprey.models.drafter.config import EAGLE3_EXTRA_LAYERS, VARIANTS


def _carried_rope_scaling(scaling) -> bool:
    """llama3 and linear scaling (Gemma 3's global RoPE) carry over to EAGLE-3's layer; YaRN does not."""
    return bool(scaling) and scaling.get("rope_type", "llama3") in ("llama3", "linear")


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
        # llama3 and linear scaling carry over; YaRN (gpt-oss) does not: SpecForge's gpt-oss EAGLE-3 layer has plain
        # RoPE.
        "rope_scaling": (
            {"rope_type": "llama3", **target.rope_scaling} if _carried_rope_scaling(target.rope_scaling) else None
        ),
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
    hidden_post_norm: bool = False  # the state passed between steps is final_layernorm(hidden)
    aux_hidden_norm: bool = False  # one RMSNorm per captured target hidden state before fusion_fc

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

    def num_parameters(self, tensor_parallel_size: int = 1) -> tuple[int, int]:
        """(trainable, frozen) parameters of the Megatron drafter build_drafter_model builds, over all TP ranks:
        its own (padded) embedding, frozen for EAGLE-3; fusion_fc and the aux norms; each layer (2H-wide QKV and
        hidden_norm where fused); the final norm and the untied draft-vocabulary output layer, always present."""
        body, h = self.body, self.hidden_size
        d = body.head_dim
        q, kv = body.num_attention_heads * d, body.num_query_groups * d
        layers = 0
        for index in range(body.num_layers):
            fused = self.layer_is_fused(index)
            qkv_in = 2 * h if fused else h
            layers += qkv_in * (q + 2 * kv) + (q + 2 * kv if body.qkv_bias else 0) + q * h
            layers += (2 * d if body.qk_layernorm else 0) + 3 * h * body.ffn_hidden_size
            layers += (3 if fused else 2) * h  # hidden_norm (fused), input_layernorm, pre_mlp_layernorm
        embedding = padded_size(self.vocab_size, tensor_parallel_size) * h
        fusion = 3 * self.target_hidden_size * h + (3 * self.target_hidden_size if self.aux_hidden_norm else 0)
        output = padded_size(self.draft_vocab_size, tensor_parallel_size) * h
        trainable = layers + fusion + h + output
        if self.variant == "eagle3":  # the target's frozen embedding
            return trainable, embedding
        return trainable + embedding, 0

    def to_dict(self) -> dict:
        return {
            "body_hf_config": self.body.hf_config | {"num_hidden_layers": self.body.num_layers},
            "target_hidden_size": self.target_hidden_size,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "aux_layer_ids": list(self.aux_layer_ids),
            "variant": self.variant,
            "eagle3_extra_layers": self.eagle3_extra_layers,
            "hidden_post_norm": self.hidden_post_norm,
            "aux_hidden_norm": self.aux_hidden_norm,
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
            hidden_post_norm=bool(data.get("hidden_post_norm", False)),
            aux_hidden_norm=bool(data.get("aux_hidden_norm", False)),
        )

    def with_drift_norms(self, drafter_config) -> "DrafterArch":
        """This arch with the drift options of a stage's DrafterConfig (Stage 3 saves an arch without them)."""
        return replace(
            self,
            hidden_post_norm=bool(drafter_config.hidden_post_norm),
            aux_hidden_norm=bool(drafter_config.aux_hidden_norm),
        )

    def reference_config(self):
        """The plain-PyTorch reference drafter's config for the same drafter."""
        from megatron_osprey.models.drafter.reference import DrafterConfig

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
            hidden_post_norm=self.hidden_post_norm,
            aux_hidden_norm=self.aux_hidden_norm,
        )
