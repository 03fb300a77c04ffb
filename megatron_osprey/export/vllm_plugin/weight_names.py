"""Names shared by `export --format vllm` and the vLLM plugin (pure Python: no vLLM, no torch).

The export writes the reference drafter's own tensor names (``layers.{i}.*``, ``fc``, ``fc_norm.{j}``,
``embed_tokens``, ``norm``, ``lm_head``, ``d2t``/``t2d``) and ``draft_layer_kinds``, one entry per layer:

* ``osprey``: attention reads ``cat(hidden_norm(g), input_layernorm(x))``, x the residual stream that
  starts from the drafter's own embedding, g the fused target features (every Osprey layer);
* ``eagle3``: attention reads ``cat(input_layernorm(e), hidden_norm(x))``, x starting from g, e the
  embedding (EAGLE-3's first layer, and every layer of a ``fused`` multi-layer EAGLE-3 drafter);
* ``plain``: attention reads ``input_layernorm(x)`` (the extra layers of a ``plain`` EAGLE-3 drafter).
"""

from __future__ import annotations

from megatron_osprey.export.sglang_plugin.weight_names import STACKED

# Stock vLLM 0.32 maps this name to Eagle3LlamaForCausalLM (one eagle3 layer, then plain layers).
STOCK_ARCHITECTURE = "LlamaForCausalLMEagle3"
# Only this plugin registers these (vLLM keeps names that start with "Eagle3" as they are); stock vLLM
# refuses them, so an export that needs the plugin cannot be served half-right without it.
PLUGIN_ARCHITECTURES = ("Eagle3OspreyLlamaForCausalLM", "Eagle3OspreyQwen3ForCausalLM")
LAYER_KINDS = ("osprey", "eagle3", "plain")
KINDS_KEY = "draft_layer_kinds"


def _getter(config):
    return config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))


def layer_kinds(config) -> list[str]:
    """The validated ``draft_layer_kinds`` of a plugin config (nothing is assumed when it is absent)."""
    get = _getter(config)
    kinds, n = get(KINDS_KEY, None), int(get("num_hidden_layers", 0))
    problem = None
    if not isinstance(kinds, (list, tuple)) or len(kinds) != n:
        problem = f"must list one kind per layer ({n})"
    elif any(kind not in LAYER_KINDS for kind in kinds):
        problem = f"must hold only {LAYER_KINDS}"
    elif kinds[0] == "plain" or (kinds[0] == "osprey") != all(kind == "osprey" for kind in kinds):
        problem = "must be all 'osprey', or 'eagle3' followed by 'eagle3' or 'plain' layers"
    if problem:
        raise ValueError(
            f"the draft config.json's {KINDS_KEY} {problem} (got {kinds!r}); re-export the drafter with "
            f"`osprey export --format vllm`."
        )
    return list(kinds)


def vllm_param_name(name: str) -> tuple[str, object] | None:
    """(vLLM parameter name, shard id or None) of an exported tensor; None for ``t2d`` (vLLM needs only d2t).

    vLLM fuses q/k/v into ``qkv_proj`` (shards "q", "k", "v") and gate/up into ``gate_up_proj`` (0, 1).
    """
    if name == "t2d":
        return None
    if name == "d2t":
        return "draft_id_to_target_id", None
    if name == "lm_head.weight":
        return name, None
    for source, fused, shard in STACKED:
        if f".{source}." in name:
            return "model." + name.replace(f".{source}.", f".{fused}."), shard
    return "model." + name, None
