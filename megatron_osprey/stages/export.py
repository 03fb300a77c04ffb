"""Export a drafter checkpoint (Megatron, Stage 3 output or reference dir) for serving."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_osprey.eval.loading import load_drafter
from megatron_osprey.export.formats import FORMATS, export_drafter


@dataclass
class ExportConfig:
    """tools/export_checkpoint.py settings."""

    checkpoint: Path
    format: str
    output: Path
    overwrite: bool = False


def export_checkpoint(config: ExportConfig) -> Path:
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
