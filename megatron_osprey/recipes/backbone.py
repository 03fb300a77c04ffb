"""Stage 2 recipes: Qwen3-4B's first two layers pretrained on FineWeb, on 8 nodes x 8 GPUs.

The paper pretrains 55k steps, about 462B tokens of FineWeb (sample-100BT); its ablation (evidence 05) finds
that 10k steps capture nearly all of the gain. Neither the paper nor the release fixes the batch, the sequence
length or the schedule; 462B tokens / 55k steps = 8.4M tokens per step, which is a global batch of 2,048
sequences of 4,096 tokens (461.4B tokens in 55k steps). The learning-rate schedule (3e-4 cosine to 3e-5,
weight decay 0.1) is this project's choice. Precision: BF16, or FP8 for the backbone's GEMMs (hybrid with
delayed scaling on H100, MXFP8 on B200); the LM head stays BF16.
"""

from __future__ import annotations

from megatron_osprey.models.backbone.config import BackboneConfig
from megatron_osprey.recipes.recipe import Recipe, Resources, Slurm
from megatron_osprey.stages.preprocess import PreprocessConfig
from megatron_osprey.stages.pretrain import PretrainConfig
from megatron_osprey.stages.prune import PruneConfig
from megatron_osprey.training.config import LoggingConfig, OptimizerConfig, TrainingConfig

# precision suffix -> (fp8_format, fp8_recipe) of the backbone's GEMMs
FP8 = {"bf16": (None, "delayed"), "fp8": ("hybrid", "delayed"), "mxfp8": ("e4m3", "mxfp8")}
PAPER_STEPS_FULL = 55_000
PAPER_STEPS_BUDGET = 10_000
GLOBAL_BATCH = 2_048  # 462B tokens / 55k steps / 4,096 tokens per sequence
# The release's two backbones (LeanModels/Osprey README.md): the source LM preset and the blocks Stage 1 keeps. The
# Qwen3-4B 2-layer backbone gives the headline results; LayerSkip-Llama 4-layer is the other one the paper reports.
BACKBONE_LAYERS = {"qwen3_4b": 2, "layerskip_llama32_1b": 4}
PREPROCESS_FILES = 16  # preprocessing array tasks; task k of 16 tokenizes shards k, k + 16, ... of paths.pretrain_text


def backbone_pretrain(steps: int, hardware: str, precision: str, source: str = "qwen3_4b") -> Recipe:
    """prune -> preprocess -> pretrain for `steps` updates on 64 GPUs at the paper's tokens per step, of `source`'s
    first BACKBONE_LAYERS[source] blocks."""
    fp8_format, fp8_recipe = FP8[precision]
    pretrain = PretrainConfig(
        model=BackboneConfig(
            bf16=True, transformer_impl="transformer_engine", fp8_format=fp8_format, fp8_recipe=fp8_recipe
        ),
        training=TrainingConfig(micro_batch_size=4, global_batch_size=GLOBAL_BATCH, train_iters=steps),
        # DP 64 under the distributed optimizer: the reduce-scatter and the all-gather hide behind compute.
        optimizer=OptimizerConfig(
            lr_warmup_iters=2000 if steps > 20_000 else 500,
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
        ),
        logging=LoggingConfig(eval_iters=20, wandb_project="osprey"),
    )
    pretrain.checkpoint.save_interval = 1000
    hours = "48:00:00" if steps > 20_000 else "12:00:00"
    return Recipe(
        name="",
        hardware=hardware,
        precision=precision,
        chain=("prune", "preprocess", "pretrain"),
        source=source,
        budget=(
            f"{steps:,} steps of the paper ({'full run' if steps > 20_000 else 'the 10k-step budget of its ablation'});"
            f" global batch {GLOBAL_BATCH:,} x 4,096 tokens derived from 462B tokens / 55k steps"
        ),
        prune=PruneConfig(num_layers=BACKBONE_LAYERS[source]),
        preprocess=PreprocessConfig(workers=32),
        pretrain=pretrain,
        resources={
            "prune": Resources(cpus_per_task=16, time="01:00:00"),
            "preprocess": Resources(gpus_per_node=1, array_tasks=PREPROCESS_FILES, cpus_per_task=32, time="08:00:00"),
            "pretrain": Resources(nodes=8, gpus_per_node=8, time=hours),
        },
        slurm=Slurm(),
    )


def backbone_monolingual_pretrain(hardware: str, precision: str, language: str | None = None) -> Recipe:
    """Stage 2 at the 10k-step budget on a user's monolingual corpus (`--set paths.pretrain_text=FILE`), as the
    monolingual fine-tuning strategy for multilingual drafting; the recipe's domain names the language."""
    recipe = backbone_pretrain(PAPER_STEPS_BUDGET, hardware, precision)
    recipe.domain = language
    recipe.paths.pretrain_text = "{root}/data/monolingual/{domain}.jsonl"
    recipe.resources["preprocess"].array_tasks = 1  # one corpus file, not FineWeb's shard list
    recipe.budget = (
        f"{PAPER_STEPS_BUDGET:,} steps (the paper's 10k-step budget) at its {GLOBAL_BATCH:,} x 4,096 tokens per step;"
        f" a smaller corpus is repeated: size it with --set pretrain.training.train_iters=N"
    )
    return recipe
