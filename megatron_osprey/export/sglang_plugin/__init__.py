"""SGLang model plugin for Osprey drafters and multi-layer EAGLE-3 drafters (no SGLang source patch).

Serve with (sglang==0.5.23, the version the `serve` extra pins and the plugin is written against)::

    SGLANG_EXTERNAL_MODEL_PACKAGE=megatron_osprey.export.sglang_plugin \\
    python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 \\
        --speculative-draft-model-path EXPORTED_DRAFTER ...

SGLang imports every module of the package named by that variable and registers each module's
``EntryClass`` by class name. ``eagle3_models`` (which imports SGLang) provides
``OspreyLlamaForCausalLMEagle3`` and ``OspreyQwen3ForCausalLMEagle3``, names stock SGLang does not
know: an export that needs the plugin is refused without it, and stock ``LlamaForCausalLMEagle3``
drafts (one-layer EAGLE-3, third-party drafts) keep SGLang's own code. ``weight_names`` is pure
PyTorch so this package imports, and is tested, without SGLang.
"""
