"""Export a drafter checkpoint for serving.

    python tools/export_checkpoint.py --checkpoint CKPT --format sglang|hf|speculators --output DIR [--overwrite]
    (python -m megatron_osprey.stages.export takes the same flags)

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
from dataclasses import dataclass
from pathlib import Path

from megatron_osprey.eval.loading import load_drafter
from megatron_osprey.export.formats import FORMATS, export_drafter
from megatron_osprey.stages.cli import config_from_flags, exit_code


@dataclass
class ExportConfig:
    """Export settings (the flags of the same names)."""

    checkpoint: Path
    format: str
    output: Path
    overwrite: bool = False


def run(config: ExportConfig) -> Path:
    """Load any drafter checkpoint (Megatron, Stage 3 output, reference dir) and export it."""
    if config.format not in FORMATS:
        raise ValueError(f"--format must be one of {FORMATS}, got {config.format!r}.")
    output = Path(config.output)
    if output.exists() and output.is_dir() and any(output.iterdir()) and not config.overwrite:
        raise FileExistsError(f"--output {output} exists and is not empty; pass --overwrite to replace it.")
    loaded = load_drafter(config.checkpoint, "--checkpoint")
    target = loaded.run_config.get("target")
    tokenizer_dir = Path(target) if target and Path(target).is_dir() else None
    return export_drafter(loaded.drafter, config.format, output, loaded.run_config, config.overwrite, tokenizer_dir)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Parse the flags, export, print where; returns the exit code (2: bad input, one line)."""
    args = parse_args(argv)

    def export_and_report() -> None:
        out = run(config_from_flags(ExportConfig, args))
        print(f"exported {args.checkpoint} as {args.format} -> {out}")

    return exit_code(export_and_report)


if __name__ == "__main__":
    sys.exit(main())
