"""Model shape facts recipes carry, so planning needs no download.

Sources of the figures (public config.json files):
- Qwen3-4B / Qwen3-8B: Qwen/Qwen3-4B and Qwen/Qwen3-8B config.json on the Hugging Face Hub.
- Llama-3.3-70B: meta-llama/Llama-3.3-70B-Instruct config.json.
- MiniMax-M2.5: 62 layers, hidden 3072, 48 heads, 8 kv heads, head_dim 128, 256 experts top-8,
  expert ffn 1536, rotary_dim 64, vocab 200,064, untied: the M2-family config.json as published
  for MiniMax-M2.1 (huggingface.co/QuixiAI/MiniMax-M2.1-bf16), whose vocab size and expert count
  huggingface.co/tiny-random/minimax-m2.5 (auto_map -> MiniMaxAI/MiniMax-M2.5) repeats; ~230B total
  per xorbitsai/inference's MiniMax-M2.5 model card.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

from megatron_osprey.base.arch import ModelArch


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The architecture numbers of one decoder-only LM (dense or mixture of experts)."""

    name: str
    family: str  # HF model_type: qwen3, llama, minimax_m2
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    rotary_dim: int = 0

    def hf_config(self) -> dict[str, Any]:
        """A minimal HF config.json dict, enough for ModelArch (no RoPE scaling: planning ignores it)."""
        config: dict[str, Any] = {
            "model_type": self.family,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.ffn_hidden_size,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "bfloat16",
        }
        if self.family == "minimax_m2":
            # MiniMax-M2 names the per-expert width intermediate_size.
            config.update(
                intermediate_size=self.moe_ffn_hidden_size,
                num_local_experts=self.num_experts,
                num_experts_per_tok=self.moe_router_topk,
                scoring_func="sigmoid",
                use_routing_bias=True,
                rotary_dim=self.rotary_dim,
                qk_norm_type="per_layer",
            )
        elif self.family == "qwen3_moe":
            config.update(
                num_experts=self.num_experts,
                moe_intermediate_size=self.moe_ffn_hidden_size,
                num_experts_per_tok=self.moe_router_topk,
            )
        return config

    def arch(self) -> ModelArch:
        """The library's normalized architecture for this shape."""
        return ModelArch.from_hf_config(self.hf_config(), source=f"model shape {self.name!r}")

    def num_parameters(self) -> int:
        """Total parameters (embedding counted once when tied)."""
        return self.arch().num_parameters()


QWEN3_4B = ModelShape(
    "qwen3_4b",
    "qwen3",
    num_layers=36,
    hidden_size=2560,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    ffn_hidden_size=9728,
    vocab_size=151_936,
    tie_word_embeddings=True,
)
# The Osprey backbone: Qwen3-4B's embedding, first two blocks, final norm and tied head (~591M).
QWEN3_4B_2LAYER = dataclasses.replace(QWEN3_4B, name="qwen3_4b_2layer", num_layers=2)
QWEN3_8B = ModelShape(
    "qwen3_8b",
    "qwen3",
    num_layers=36,
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    ffn_hidden_size=12_288,
    vocab_size=151_936,
)
LLAMA33_70B = ModelShape(
    "llama33_70b",
    "llama",
    num_layers=80,
    hidden_size=8192,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
    ffn_hidden_size=28_672,
    vocab_size=128_256,
)
MINIMAX_M25 = ModelShape(
    "minimax_m25",
    "minimax_m2",
    num_layers=62,
    hidden_size=3072,
    num_attention_heads=48,
    num_key_value_heads=8,
    head_dim=128,
    ffn_hidden_size=1536,
    vocab_size=200_064,
    num_experts=256,
    moe_ffn_hidden_size=1536,
    moe_router_topk=8,
    rotary_dim=64,
)
# Toy shapes for CPU runs; TINY_SOURCE matches the small LM `make demo` builds.
TINY_SOURCE = ModelShape(
    "tiny_source",
    "qwen3",
    num_layers=6,
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    ffn_hidden_size=384,
    vocab_size=512,
    tie_word_embeddings=True,
)
TINY_BACKBONE = dataclasses.replace(TINY_SOURCE, name="tiny_backbone", num_layers=2)
TINY_TARGET = ModelShape(
    "tiny_target",
    "qwen3",
    num_layers=4,
    hidden_size=192,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=48,
    ffn_hidden_size=512,
    vocab_size=512,
)

SHAPES: types.MappingProxyType[str, ModelShape] = types.MappingProxyType(
    {
        s.name: s
        for s in (
            QWEN3_4B,
            QWEN3_4B_2LAYER,
            QWEN3_8B,
            LLAMA33_70B,
            MINIMAX_M25,
            TINY_SOURCE,
            TINY_BACKBONE,
            TINY_TARGET,
        )
    }
)


def shape_from(value: Any, where: str) -> ModelShape | None:
    """A ModelShape from a shape name, a dict of its fields, or None; `where` names the key for errors."""
    if value is None or isinstance(value, ModelShape):
        return value
    if isinstance(value, str):
        if value not in SHAPES:
            raise ValueError(f"{where}: unknown model shape {value!r}; known: {', '.join(sorted(SHAPES))}.")
        return dataclasses.replace(SHAPES[value])
    if isinstance(value, dict):
        base = value.get("base")
        fields = {k: v for k, v in value.items() if k != "base"}
        names = {f.name for f in dataclasses.fields(ModelShape)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise ValueError(f"{where}: unknown model shape keys {unknown}; valid keys: {', '.join(sorted(names))}.")
        if base is not None:
            return dataclasses.replace(shape_from(base, where), **fields)
        try:
            return ModelShape(**fields)
        except TypeError as err:
            raise ValueError(f"{where}: incomplete model shape ({err}).") from None
    raise ValueError(f"{where}: expected a shape name or a mapping, got {type(value).__name__}.")
