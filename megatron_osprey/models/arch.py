"""The architecture facts of a HF decoder-only LM, normalized across families."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch

# model_type in config.json -> (family, HF class name)
SUPPORTED_FAMILIES: dict[str, str] = {
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
}


@dataclasses.dataclass(frozen=True)
class ModelArch:
    """What Megatron-Core needs to rebuild a Qwen3 / Llama model from its HF config."""

    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    qk_layernorm: bool
    qkv_bias: bool
    tie_word_embeddings: bool
    torch_dtype: str
    hf_config: dict[str, Any] = dataclasses.field(repr=False, compare=False, hash=False)

    @classmethod
    def from_hf_config(cls, config: Any, source: str = "config.json") -> "ModelArch":
        """Build from a transformers config object, a dict, or a path to config.json / its directory."""
        if isinstance(config, (str, Path)):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            if not path.is_file():
                raise FileNotFoundError(f"HF config not found: {path} (expected a config.json).")
            source = str(path)
            config = json.loads(path.read_text())
        if not isinstance(config, dict):
            config = config.to_dict()
        config = dict(config)
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"{source}: unsupported architecture model_type={model_type!r} "
                f"(architectures={config.get('architectures')}); supported: "
                f"{', '.join(sorted(SUPPORTED_FAMILIES))}."
            )
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        rope = dict(config.get("rope_parameters") or {})
        legacy_scaling = config.get("rope_scaling")
        if legacy_scaling:
            rope.update(legacy_scaling)
        theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"{source}: rope_type {rope_type!r} is not supported (default, llama3).")
        scaling = None
        if rope_type == "llama3":
            scaling = {
                k: rope[k]
                for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            }
        dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
        return cls(
            family=model_type,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            ffn_hidden_size=int(config["intermediate_size"]),
            num_attention_heads=heads,
            num_query_groups=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            qk_layernorm=model_type == "qwen3",
            qkv_bias=bool(config.get("attention_bias", False)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            torch_dtype=str(dtype).replace("torch.", ""),
            hf_config=config,
        )

    @property
    def hf_architecture(self) -> str:
        return SUPPORTED_FAMILIES[self.family]

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def with_num_layers(self, num_layers: int) -> "ModelArch":
        """The same architecture truncated to its first `num_layers` blocks."""
        config = dict(self.hf_config, num_hidden_layers=num_layers)
        for key in ("layer_types", "max_window_layers"):
            if isinstance(config.get(key), list):
                config[key] = config[key][:num_layers]
        if isinstance(config.get("max_window_layers"), int):
            config["max_window_layers"] = min(config["max_window_layers"], num_layers)
        return dataclasses.replace(self, num_layers=num_layers, hf_config=config)

    def padded_vocab_size(self, tensor_parallel_size: int, divisible_by: int = 128) -> int:
        """Megatron's vocab padding: a multiple of divisible_by x TP."""
        multiple = divisible_by * tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def validate_parallel(self, tensor_parallel_size: int, pipeline_parallel_size: int = 1) -> None:
        """Raise one clear error when TP/PP do not divide heads, kv-heads, FFN or layers."""
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        checks = [
            ("num_attention_heads", self.num_attention_heads, tp, "--tensor-model-parallel-size"),
            ("num_key_value_heads", self.num_query_groups, tp, "--tensor-model-parallel-size"),
            ("intermediate_size", self.ffn_hidden_size, tp, "--tensor-model-parallel-size"),
            ("num_hidden_layers", self.num_layers, pp, "--pipeline-model-parallel-size"),
        ]
        for name, value, size, flag in checks:
            if value % size:
                raise ValueError(
                    f"{flag} {size} does not divide the model's {name} ({value}); "
                    f"choose a size that divides {value}."
                )

    def torch_dtype_obj(self) -> torch.dtype:
        return getattr(torch, self.torch_dtype)

    def rotary_inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies exactly as the HF model computes them (default or llama3)."""
        dim = self.head_dim
        inv_freq = 1.0 / (
            self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
        if self.rope_scaling is None:
            return inv_freq
        factor = float(self.rope_scaling["factor"])
        low = float(self.rope_scaling["low_freq_factor"])
        high = float(self.rope_scaling["high_freq_factor"])
        old_len = float(self.rope_scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)

    def num_parameters(self) -> int:
        """Parameter count of the HF model (embedding counted once when tied)."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_query_groups * d
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0)
        attn += 2 * d if self.qk_layernorm else 0
        layer = attn + 3 * h * f + 2 * h
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * layer + embed + head + h
