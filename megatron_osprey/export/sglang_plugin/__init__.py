"""SGLang model plugin for Osprey drafters and multi-layer EAGLE-3 drafters (no SGLang source patch).

Serve with::

    SGLANG_EXTERNAL_MODEL_PACKAGE=megatron_osprey.export.sglang_plugin \\
    python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 \\
        --speculative-draft-model-path EXPORTED_DRAFTER ...

SGLang imports every module of the package named by that variable and registers each module's
``EntryClass`` by class name, overriding its built-in classes of the same name. ``eagle3_models``
(which imports SGLang) provides ``Qwen3ForCausalLMEagle3`` and ``LlamaForCausalLMEagle3``; a plain
one-layer EAGLE-3 draft still runs SGLang's own code. ``weight_names`` is pure PyTorch so this
package imports, and is tested, without SGLang.
"""
