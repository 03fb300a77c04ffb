"""sglang.srt.layers.vocab_parallel_embedding stand-in at TP 1."""

import torch
from torch import nn

from sglang.srt.model_loader.weight_utils import default_weight_loader


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings, embedding_dim, params_dtype=None, org_num_embeddings=None,
                 padding_size=64, quant_config=None, prefix="", **kwargs):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids):
        return nn.functional.embedding(input_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, num_embeddings, embedding_dim, bias=False, params_dtype=None, org_num_embeddings=None,
                 padding_size=64, quant_config=None, prefix="", **kwargs):
        super().__init__(num_embeddings, embedding_dim)

    def forward(self, input_):
        raise RuntimeError("LMHead's weights should be used in the sampler.")
