"""sglang.srt.layers.vocab_parallel_embedding stand-in at TP 1."""

import torch
from torch import nn

from sglang.srt.model_loader.weight_utils import default_weight_loader as _default_weight_loader

DEFAULT_VOCAB_PADDING_SIZE = 64


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings, embedding_dim, *, params_dtype=None, output_dtype=None,
                 org_num_embeddings=None, padding_size=DEFAULT_VOCAB_PADDING_SIZE, quant_config=None, prefix="",
                 enable_tp=True, use_attn_tp_group=False, use_presharded_weights=False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded_weight):
        _default_weight_loader(param, loaded_weight)

    def forward(self, input_):
        return nn.functional.embedding(input_, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, num_embeddings, embedding_dim, *, bias=False, params_dtype=None, org_num_embeddings=None,
                 padding_size=DEFAULT_VOCAB_PADDING_SIZE, quant_config=None, prefix="", enable_tp=True,
                 use_attn_tp_group=False, use_presharded_weights=False):
        super().__init__(num_embeddings, embedding_dim)

    def forward(self, input_):
        raise RuntimeError("LMHead's weights should be used in the sampler.")
