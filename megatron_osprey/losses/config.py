"""The TTT loss's config and flags (torch-free: recipes and `osprey plan` read it); losses/ttt.py explains both
conventions."""

from __future__ import annotations

import dataclasses

from megatron_osprey.config.flags import Flag

MASK_ALIGNMENTS = ("predicted", "reference")
NORMALIZATIONS = ("tokens", "reference")


@dataclasses.dataclass
class TTTLossConfig:
    """K steps (5 for both arms in the paper) weighted decay**k; the two conventions of the module docstring."""

    ttt_steps: int = 5
    decay: float = 0.8
    mask_alignment: str = "predicted"
    normalization: str = "tokens"

    def __post_init__(self) -> None:
        if self.mask_alignment not in MASK_ALIGNMENTS:
            raise ValueError(f"--ttt-mask-alignment must be one of {MASK_ALIGNMENTS}, got {self.mask_alignment!r}.")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"--ttt-normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}.")

    def weights(self) -> list[float]:
        return [self.decay**k for k in range(self.ttt_steps)]


TTT_FLAGS = [
    Flag("--ttt-steps", "ttt_steps", {"type": int, "help": "training-time-test length (5 for both arms in the paper)"}),
    Flag("--ttt-decay", "decay", {"type": float, "help": "step k weighs decay**k (0.8)"}),
    Flag(
        "--ttt-mask-alignment",
        "mask_alignment",
        {
            "choices": list(MASK_ALIGNMENTS),
            "help": "count row t of step k when x_{t+2+k} (predicted, default) or x_{t+k} (SpecForge) is assistant",
        },
    ),
    Flag(
        "--ttt-normalization",
        "normalization",
        {
            "choices": list(NORMALIZATIONS),
            "help": "divide by step 0's counted rows (tokens, default) or per sample by its length (SpecForge)",
        },
    ),
]
