#!/usr/bin/env python
"""Stage 3: adapt a pretrained Osprey backbone to a target model.

    python tools/adapt_drafter.py --backbone BACKBONE_DIR --target TARGET_DIR --output OUT
        [--aux-layer-ids 1 15 28] [--draft-vocab-size 32000 --token-counts counts.json]

BACKBONE_DIR is the --output of Stage 1 (tools/prune_backbone.py) or Stage 2.
TARGET_DIR holds the target's config.json and tokenizer; no weights are read.
Writes OUT/megatron/ (dist checkpoint), OUT/hf/ (reference drafter) and
OUT/tokenizer_alignment.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", required=True, type=Path)
    parser.add_argument("--target", required=True, type=Path)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--aux-layer-ids", type=int, nargs=3, default=None,
                        help="0-based target layers whose outputs feed fusion_fc (default [1, L//2-1, L-4])")
    parser.add_argument("--draft-vocab-size", type=int, default=None, help="reduced draft vocabulary (top-K ids)")
    parser.add_argument("--token-counts", type=Path, default=None, help="JSON list/object of target-token counts")
    parser.add_argument("--alignment-policy", choices=["reference", "bytes_and_roles"], default="reference",
                        help="vocabulary alignment for rows without a byte-identical backbone token: Osprey's "
                             "released rule (default) or this project's byte/role rule")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--overwrite", action="store_true")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_osprey.parallel import ParallelConfig, parallel_context
    from megatron_osprey.stages.adapt import AdaptConfig, adapt_drafter

    config = AdaptConfig(
        backbone=args.backbone, target=args.target, output=args.output, aux_layer_ids=args.aux_layer_ids,
        draft_vocab_size=args.draft_vocab_size, token_counts=args.token_counts, overwrite=args.overwrite,
        alignment_policy=args.alignment_policy,
    )
    with parallel_context(ParallelConfig(tensor_model_parallel_size=args.tensor_model_parallel_size)) as state:
        try:
            report = adapt_drafter(config, state)
        except (ValueError, OSError) as error:  # OSError: unreadable input, read-only or full output
            print(f"error: {error}", file=sys.stderr)
            return 2
        if state.rank == 0:
            counts = report["counts"]
            print(json.dumps({"policy": report["policy"], "counts": counts,
                              "draft_vocab_size": report["draft_vocab_size"], "aux_layer_ids": report["aux_layer_ids"]}))
            rows = ", ".join(f"{count:,} {kind}" for kind, count in counts.items())
            print(f"adapted {args.backbone} -> {args.output} for {args.target} ({report['policy']} alignment): {rows}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
