"""sglang.srt.layers.logits_processor stand-in: logits of every position (no sampling metadata)."""

from types import SimpleNamespace

import torch
from torch import nn


class LogitsProcessor(nn.Module):
    def __init__(self, config, skip_all_gather: bool = False, logit_scale=None, return_full_logits: bool = False):
        super().__init__()
        self.vocab_size = config.vocab_size

    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None,
                hidden_states_before_norm=None):
        logits = torch.matmul(hidden_states, lm_head.weight.T)[..., : self.vocab_size]
        return SimpleNamespace(next_token_logits=logits, hidden_states=aux_hidden_states)
