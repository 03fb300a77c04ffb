"""`python -m megatron_osprey.distill` flags: Stage 2's Megatron-named groups plus the drafter and target.

Precedence as in Stage 2: dataclass defaults (the paper's) < `--recipe` < typed flags < `--set`.
"""

from __future__ import annotations

import argparse

from megatron_osprey.config.args import ARGUMENT_GROUPS, STORE_TRUE, Flag, apply_flags, build_parser
from megatron_osprey.config.distill import BASELINES, MODES, DistillConfig
from megatron_osprey.config.pretrain import FP8_FORMATS, FP8_RECIPES

SHARED_GROUPS = ("distributed", "training", "learning rate", "checkpointing", "logging")
# Shared flags Stage 4 has no use for: it runs no validation split. argparse refuses them by name.
NOT_HONOURED = ("--eval-interval", "--eval-iters")

_OWN_GROUPS: dict[str, list[Flag]] = {
    "drafter": [
        ("--drafter-init", "drafter.drafter_init", {"help": "Stage 3 output (tools/adapt_drafter.py --output)"}),
        ("--baseline", "drafter.baseline", {"choices": list(BASELINES), "help": "train EAGLE-3 from scratch instead"}),
        ("--eagle3-num-layers", "drafter.eagle3_num_layers", {"type": int}),
        (
            "--eagle3-extra-layers",
            "drafter.eagle3_extra_layers",
            {
                "choices": ["fused", "plain"],
                "help": "EAGLE-3 layers after the first: fused (the paper's 2-layer baseline) or plain",
            },
        ),
        ("--draft-vocab-size", "drafter.draft_vocab_size", {"type": int, "help": "EAGLE-3's reduced vocabulary"}),
        ("--aux-layer-ids", "drafter.aux_layer_ids", {"type": int, "nargs": 3}),
        ("--transformer-impl", "drafter.transformer_impl", {"choices": ["auto", "local", "transformer_engine"]}),
        ("--bf16", "drafter.bf16", STORE_TRUE),
        (
            "--ttt-steps",
            "ttt.ttt_steps",
            {"type": int, "help": "training-time-test length (5 for both arms in the paper)"},
        ),
        ("--ttt-decay", "ttt.decay", {"type": float, "help": "step k weighs decay**k (0.8)"}),
        (
            "--ttt-mask-alignment",
            "ttt.mask_alignment",
            {
                "choices": ["predicted", "reference"],
                "help": "count row t of step k when x_{t+2+k} (predicted, default) or x_{t+k} (SpecForge) is assistant",
            },
        ),
        (
            "--ttt-normalization",
            "ttt.normalization",
            {
                "choices": ["tokens", "reference"],
                "help": "divide by step 0's counted rows (tokens, default) or each step by B*T (SpecForge)",
            },
        ),
    ],
    "target and data": [
        ("--target", "target.target", {"help": "the target's HF directory (config, tokenizer, weights)"}),
        ("--mode", "target.mode", {"choices": list(MODES)}),
        ("--target-tensor-model-parallel-size", "target.tensor_model_parallel_size", {"type": int}),
        ("--target-pipeline-model-parallel-size", "target.pipeline_model_parallel_size", {"type": int}),
        ("--target-expert-model-parallel-size", "target.expert_model_parallel_size", {"type": int}),
        ("--target-expert-tensor-parallel-size", "target.expert_tensor_parallel_size", {"type": int}),
        (
            "--target-fp8-format",
            "target.fp8_format",
            {"choices": list(FP8_FORMATS), "help": "FP8 forward of the frozen target (refused: not implemented)"},
        ),
        ("--target-fp8-recipe", "target.fp8_recipe", {"choices": list(FP8_RECIPES)}),
        ("--hidden-states", "target.hidden_states", {"help": "offline: the store from tools/extract_hidden_states.py"}),
        ("--data-path", "data.data_path", {"nargs": "+", "help": "conversations JSONL file(s)"}),
        ("--domain", "data.domain", {"help": "name of the training domain (eval's train x eval matrix)"}),
        ("--enable-thinking", "data.enable_thinking", {"action": "store_true", "default": argparse.SUPPRESS}),
        ("--no-shuffle", "data.shuffle", {"action": "store_false"}),
        (
            "--lr-warmup-fraction",
            "lr_warmup_fraction",
            {"type": float, "help": "warmup as a fraction of the run (0.04)"},
        ),
    ],
}
# Every flag Stage 4 takes: the shared groups without the validation flags, then its own.
DISTILL_GROUPS: dict[str, list[Flag]] = {
    title: [entry for entry in ARGUMENT_GROUPS[title] if entry[0] not in NOT_HONOURED] for title in SHARED_GROUPS
} | _OWN_GROUPS


def distill_parser() -> argparse.ArgumentParser:
    """The Stage 4 parser."""
    return build_parser(
        "python -m megatron_osprey.distill",
        "Stage 4: distill an Osprey (or EAGLE-3) drafter with the TTT loss.",
        "distill",
        DISTILL_GROUPS,
    )


def distill_config_from_args(argv: list[str] | None) -> DistillConfig:
    """Parse argv into a resolved DistillConfig (recipe, then flags, then --set)."""
    namespace = vars(distill_parser().parse_args(argv))
    return apply_flags(namespace.pop("recipe", None) or DistillConfig(), namespace)
