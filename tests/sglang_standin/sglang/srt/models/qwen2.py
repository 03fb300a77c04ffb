"""sglang.srt.models.qwen2 stand-in: Qwen2MLP (Qwen3's MLP), the Llama MLP under Qwen2's constructor."""

from sglang.srt.models.llama import LlamaMLP as _LlamaMLP


class Qwen2MLP(_LlamaMLP):
    def __init__(self, hidden_size, intermediate_size, hidden_act, quant_config=None, prefix="", reduce_results=True):
        super().__init__(hidden_size, intermediate_size, hidden_act, quant_config, prefix, reduce_results)
