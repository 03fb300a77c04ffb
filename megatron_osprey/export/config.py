"""The serving formats a drafter exports to (torch-free: the export stage's flags and recipes read it)."""

FORMATS = ("sglang", "hf", "speculators", "vllm")

# Which architecture names an sglang export's config.json carries: "osprey", the names only this project's
# SGLang plugin registers; "release", the names Osprey's release registers in its patched SGLang
# (Qwen3ForCausalLMEagle3 for a q/k-norm body, LlamaForCausalLMEagle3 otherwise).
ARCHITECTURE_NAMES = ("osprey", "release")
