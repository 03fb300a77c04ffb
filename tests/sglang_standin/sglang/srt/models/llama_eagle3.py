"""sglang.srt.models.llama_eagle3 stand-in: the stock draft class the plugin subclasses (its parts the
plugin relies on: LlamaForCausalLM's forward and set_embed, the draft window hook)."""

from sglang.srt.models.llama import LlamaForCausalLM


class LlamaForCausalLMEagle3(LlamaForCausalLM):
    def get_hot_token_id(self):
        return self.hot_token_id

    def get_attention_sliding_window_size(self):
        return self._draft_window_size


EntryClass = [LlamaForCausalLMEagle3]
