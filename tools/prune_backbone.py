#!/usr/bin/env python
"""Stage 1: prune a HF small LM (e.g. Qwen3-4B) to its first N blocks.

    python tools/prune_backbone.py --source HF_DIR --num-layers 2 --output OUT
    torchrun --nproc_per_node=2 tools/prune_backbone.py ... --tensor-model-parallel-size 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True, type=Path, help="HF model directory (config.json + safetensors + tokenizer)")
    parser.add_argument("--num-layers", required=True, type=int, help="blocks to keep (the paper: 2)")
    parser.add_argument("--output", required=True, type=Path, help="writes OUT/megatron, OUT/hf, OUT/run_config.yaml")
    parser.add_argument("--strategy", default="first", choices=["first", "importance"],
                        help="first N blocks (paper), or Minitron layer importance via nvidia-modelopt (GPU)")
    parser.add_argument("--calibration-data", type=Path, default=None, help="JSONL with 'text' for --strategy importance")
    parser.add_argument("--transformer-impl", default="auto", choices=["auto", "local", "transformer_engine"])
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_osprey.parallel import ParallelConfig, parallel_context
    from megatron_osprey.stages.prune import PruneConfig, prune_backbone, validate

    config = PruneConfig(
        source=args.source,
        output=args.output,
        num_layers=args.num_layers,
        strategy=args.strategy,
        transformer_impl=args.transformer_impl,
        overwrite=args.overwrite,
        calibration_data=args.calibration_data,
    )
    try:
        validate(config)  # fail before any process group exists
    except (ValueError, OSError) as error:  # OSError: unreadable input, read-only output
        print(f"error: {error}", file=sys.stderr)
        return 2
    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    with parallel_context(parallel) as state:
        try:
            result = prune_backbone(config, state)
        except (ValueError, RuntimeError, OSError) as error:  # OSError: read-only or full output
            print(f"error: {error}", file=sys.stderr)
            return 2
        if state.rank == 0:
            arch = result.arch
            print(
                f"pruned {config.source} -> {config.output}: kept layers {result.kept_layers}, "
                f"{result.num_parameters:,} parameters "
                f"({'tied' if arch.tie_word_embeddings else 'untied'} embedding, vocab {arch.vocab_size:,}, "
                f"hidden {arch.hidden_size})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
