"""Export drafters to serving layouts: SGLang (plus a model plugin), HF reference, vLLM speculators."""
