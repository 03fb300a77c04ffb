"""Fixtures for the pretraining tests: a tiny pruned Qwen3 backbone and a tiny learnable indexed corpus."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.tiny_models import VOCAB, make_hf_model, qwen3_config

EOD = VOCAB - 1


def make_corpus(prefix: str | Path, num_docs: int = 400, seed: int = 0) -> str:
    """Documents that are arithmetic progressions mod VOCAB-1, then EOD: a model can learn them quickly."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(num_docs):
        length = int(rng.integers(20, 90))
        start, step = int(rng.integers(0, EOD)), int(rng.choice([1, 2, 3, 5]))
        doc = (start + step * np.arange(length)) % EOD
        builder.add_document(torch.from_numpy(np.append(doc, EOD).astype(np.int64)), [length + 1])
    builder.finalize(prefix + ".idx")
    return prefix


def make_backbone(work: Path) -> Path:
    """A 4-layer tiny Qwen3 pruned to its first 2 layers (Stage 1, single rank); returns the output dir."""
    from megatron_osprey.parallel import ParallelConfig, parallel_context
    from megatron_osprey.stages.prune import PruneConfig, prune_backbone

    source, out = work / "hf_source", work / "backbone"
    config = qwen3_config(layers=4)
    config.eos_token_id = EOD
    make_hf_model(config, source)
    with parallel_context(ParallelConfig()) as state:
        prune_backbone(PruneConfig(source=source, output=out, num_layers=2, transformer_impl="local"), state)
    return out
