"""Which drafter Stage 4 trains and its numerics (torch-free: recipes and `osprey plan` read it)."""

from __future__ import annotations

import dataclasses

from megatron_osprey.config.flags import STORE_TRUE, Flag
from megatron_osprey.models.backbone.config import TRANSFORMER_IMPLS

BASELINES = ("eagle3",)
# One list of variants and extra-layer kinds for the Megatron drafter, the reference drafter and the plan.
VARIANTS = ("osprey", "eagle3")
EAGLE3_EXTRA_LAYERS = ("plain", "fused")


@dataclasses.dataclass
class DistillDrafterConfig:
    """Osprey from Stage 3's output, or the EAGLE-3 baseline from scratch."""

    drafter_init: str | None = None  # Stage 3 output (megatron/ + run_config.yaml)
    baseline: str | None = None  # "eagle3": from scratch, the target's frozen embedding
    eagle3_num_layers: int = 1  # 1 as published; 2 for the parameter-matched variant
    # Layers after the first: "fused" reads the target features again (the paper's 2-layer
    # baseline, SpecForge's layer stack); "plain" is SGLang's stock multi-layer draft.
    eagle3_extra_layers: str = "fused"
    draft_vocab_size: int = 32000  # EAGLE-3's reduced draft vocabulary
    aux_layer_ids: list[int] | None = None  # baseline only; Osprey's come from Stage 3
    transformer_impl: str = "auto"
    bf16: bool = False
    # Against attention drift (both off: faithful to Osprey and EAGLE-3). hidden_post_norm: the state a
    # chain step passes to the next is the final-normed hidden (SGLang's `norm_output`); aux_hidden_norm:
    # an RMSNorm on each captured target hidden state before fusion_fc (SGLang's `fc_norm`).
    hidden_post_norm: bool = False
    aux_hidden_norm: bool = False

    def validate(self) -> None:
        """Exactly one way to start, and known options."""
        if bool(self.drafter_init) == bool(self.baseline):
            raise ValueError("pass exactly one of --drafter-init STAGE3_OUTPUT (Osprey) or --baseline eagle3.")
        if self.baseline and self.baseline not in BASELINES:
            raise ValueError(f"--baseline must be one of {BASELINES}, got {self.baseline!r}.")
        if self.eagle3_extra_layers not in EAGLE3_EXTRA_LAYERS:
            raise ValueError(f"--eagle3-extra-layers must be fused or plain, got {self.eagle3_extra_layers!r}.")


DRAFTER_FLAGS = [
    Flag("--drafter-init", "drafter_init", {"help": "Stage 3 output (the adapt stage's --output)"}),
    Flag("--baseline", "baseline", {"choices": list(BASELINES), "help": "train EAGLE-3 from scratch instead"}),
    Flag("--eagle3-num-layers", "eagle3_num_layers", {"type": int}),
    Flag(
        "--eagle3-extra-layers",
        "eagle3_extra_layers",
        {
            "choices": list(EAGLE3_EXTRA_LAYERS),
            "help": "EAGLE-3 layers after the first: fused (the paper's 2-layer baseline) or plain",
        },
    ),
    Flag("--draft-vocab-size", "draft_vocab_size", {"type": int, "help": "EAGLE-3's reduced vocabulary"}),
    Flag("--aux-layer-ids", "aux_layer_ids", {"type": int, "nargs": 3}),
    Flag("--transformer-impl", "transformer_impl", {"choices": list(TRANSFORMER_IMPLS)}),
    Flag("--bf16", "bf16", STORE_TRUE),
    Flag(
        "--hidden-post-norm",
        "hidden_post_norm",
        {**STORE_TRUE, "help": "pass the final-normed hidden state between chain / TTT steps (against drift)"},
    ),
    Flag(
        "--aux-hidden-norm",
        "aux_hidden_norm",
        {**STORE_TRUE, "help": "RMSNorm each captured target hidden state before the fusion fc"},
    ),
]
