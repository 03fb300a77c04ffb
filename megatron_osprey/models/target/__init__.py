"""The frozen target model, one file per use.

- pipeline_stage: a target (dense or MoE) in Megatron-Core, loaded from HF safetensors, with hidden-state capture;
- online: the target inside the distillation job (aux and final hidden states per batch);
- lm_head: the target's final norm and LM head, vocab-parallel, for recomputing target logits;
- decoding: the interface speculative decoding drives (prefill, verify, commit) and its HF adapter;
- megatron_decoding: that interface over a Megatron-Core target pipeline stage.
"""
