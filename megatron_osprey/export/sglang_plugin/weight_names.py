"""Checkpoint tensor name -> SGLang plugin parameter (pure Python; the plugin's loader and the tests share it)."""

from __future__ import annotations

# SGLang fuses q/k/v into qkv_proj and gate/up into gate_up_proj; the shard id tells the loader where.
STACKED = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)
BUFFERS = ("d2t", "t2d")
# The architecture names only this plugin registers (Llama or Qwen3 layers). Stock SGLang refuses them,
# so a draft that needs the plugin cannot be served half-loaded without it.
PLUGIN_ARCHITECTURES = ("OspreyLlamaForCausalLMEagle3", "OspreyQwen3ForCausalLMEagle3")


def _getter(config):
    return config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))


def layer_kinds(config) -> list[str]:
    """ "fused" (reads cat(side, stream), width 2H) or "plain" per layer, as the export wrote them.

    A multi-layer EAGLE-3 config must say which (`eagle3_extra_layers`); nothing is assumed.
    """
    get = _getter(config)
    n = int(get("num_hidden_layers", 1))
    if get("swap_h_and_emb", False) or n == 1:
        return ["fused"] * n
    extra = get("eagle3_extra_layers", None)
    if extra not in ("fused", "plain"):
        raise ValueError(
            f"a {n}-layer EAGLE-3 draft config must set eagle3_extra_layers to 'fused' or 'plain' (got {extra!r}); "
            f"re-export it with tools/export_checkpoint.py."
        )
    return ["fused"] * n if extra == "fused" else ["fused"] + ["plain"] * (n - 1)


def plugin_param_name(name: str) -> tuple[str, object] | None:
    """(parameter name, shard id or None) for a checkpoint tensor; None for the d2t/t2d buffers."""
    if name in BUFFERS:
        return None
    if name == "lm_head.weight":
        return name, None
    if name.startswith("midlayer."):
        name = "layers.0." + name[len("midlayer.") :]
    for source, fused, shard in STACKED:
        if f".{source}." in name:
            return "model." + name.replace(f".{source}.", f".{fused}."), shard
    return "model." + name, None
