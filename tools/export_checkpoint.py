#!/usr/bin/env python
"""Export a drafter checkpoint for serving.

    python tools/export_checkpoint.py --checkpoint CKPT --format sglang|hf|speculators --output DIR [--overwrite]

CKPT: a Megatron drafter checkpoint (Stage 3 OUT/megatron, a Stage 4 save directory), a Stage 3
OUT directory, or a reference drafter directory (OUT/hf). Everything comes from the checkpoint's
run_config.yaml / config.json; nothing is fetched.

  sglang       Osprey and multi-layer EAGLE-3 -> OspreyQwen3ForCausalLMEagle3 / OspreyLlamaForCausalLMEagle3,
               names only the plugin registers (serve with
               SGLANG_EXTERNAL_MODEL_PACKAGE=megatron_osprey.export.sglang_plugin, sglang==0.5.23);
               one-layer EAGLE-3 -> stock SGLang LlamaForCausalLMEagle3 (midlayer.*), no plugin.
  hf           the reference drafter layout (ReferenceDrafter.from_pretrained reads it).
  speculators  vLLM speculators Eagle3Speculator (one-layer Llama EAGLE-3 only).

Trust: a Megatron checkpoint is torch distributed-checkpoint data, which torch unpickles. Its
.metadata is checked against an allow-list first, but load only checkpoints you trust. The
exports written here (safetensors + JSON) hold no code: they are the form to share.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_osprey.export.formats import FORMATS  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_osprey.stages.export import ExportConfig, export_checkpoint

    try:
        out = export_checkpoint(ExportConfig(args.checkpoint, args.format, args.output, args.overwrite))
    except (ValueError, OSError) as error:  # OSError: unreadable input, read-only or full output
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} as {args.format} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
