"""CPU recipes: the toy models (tests, benchmarks, laptops), the SmolLM2 smoke chain and its Draft-OPD round (the local
Slurm cluster) and SmolLM2's Stage 2 on a monolingual corpus.

All run on gloo with the local (non-TE) spec in float32. Their numbers are sized for 2 cores, not taken from the
paper; the shapes of their chains are the GPU recipes'.
"""

from __future__ import annotations

import dataclasses
import math

from megatron_osprey.data.config import DistillDataConfig, IndexedDataConfig
from megatron_osprey.data.hidden_state_store.config import HiddenStateStoreConfig
from megatron_osprey.data.regenerate.backends import SamplingParams
from megatron_osprey.losses.config import TTTLossConfig
from megatron_osprey.models.backbone.config import BackboneConfig
from megatron_osprey.models.drafter.config import DistillDrafterConfig
from megatron_osprey.models.target.config import TargetConfig
from megatron_osprey.parallel.config import ParallelConfig
from megatron_osprey.recipes.recipe import Paths, Recipe, Resources, ServerPool, Slurm
from megatron_osprey.stages.adapt import AdaptConfig
from megatron_osprey.stages.distill import DistillConfig
from megatron_osprey.stages.evaluate import EvaluateConfig
from megatron_osprey.stages.export import ExportConfig
from megatron_osprey.stages.extract import ExtractConfig
from megatron_osprey.stages.preprocess import PreprocessConfig
from megatron_osprey.stages.pretrain import PretrainConfig
from megatron_osprey.stages.prune import PruneConfig
from megatron_osprey.stages.regenerate import RegenerateConfig
from megatron_osprey.training.config import CheckpointConfig, LoggingConfig, OptimizerConfig, TrainingConfig

# The toy target has 4 layers, too few for the default [1, L//2 - 1, L - 4].
TINY_AUX = [0, 1, 2]
CPU_TASKS = 2  # gloo ranks of the multi-rank stages: the 2 cores of a laptop or CI machine


def _cpu_logging(**kwargs) -> LoggingConfig:
    return LoggingConfig(**{"log_interval": 1, "progress_bar": False, **kwargs})


def tiny_paths() -> Paths:
    return Paths(root="tiny_runs", source="{root}/models/tiny_source", target="{root}/models/tiny_target")


def tiny_backbone_pretrain() -> Recipe:
    """Stage 2 at toy scale: the 2-layer toy backbone, 2 gloo ranks (data parallel)."""
    pretrain = PretrainConfig(
        model=BackboneConfig(transformer_impl="local"),
        training=TrainingConfig(micro_batch_size=2, global_batch_size=4, seq_length=64, train_iters=20),
        optimizer=OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_fraction=0.1, weight_decay=0.01),
        data=IndexedDataConfig(split="90,10,0"),
        checkpoint=CheckpointConfig(save_interval=10),
        logging=_cpu_logging(eval_interval=10, eval_iters=2),
    )
    return Recipe(
        name="",
        hardware="cpu",
        precision="fp32",
        chain=("prune", "preprocess", "pretrain"),
        source="tiny_source",
        budget="toy: 20 steps",
        paths=tiny_paths(),
        prune=PruneConfig(num_layers=2, transformer_impl="local"),
        preprocess=PreprocessConfig(workers=1),
        pretrain=pretrain,
        resources={"pretrain": Resources(gpus_per_node=CPU_TASKS, cpus_per_task=1, time="00:30:00")},
    )


def tiny_distill(domain: str, *, tp: int, baseline: str | None = None) -> Recipe:
    """Stage 4 at toy scale: the toy target (TP `tp`) on `CPU_TASKS` (tp 2) or 1 gloo rank, the drafter online."""
    ranks = CPU_TASKS if tp > 1 else 1
    one_process = ranks == 1
    training = (
        TrainingConfig(micro_batch_size=2, global_batch_size=4, seq_length=128, train_iters=100)
        if one_process
        else TrainingConfig(micro_batch_size=2, global_batch_size=4, seq_length=64, train_iters=math.ceil(3 * 16 / 4))
    )
    optimizer = (
        OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_fraction=0.04, weight_decay=0.0, clip_grad=1.0)
        if one_process
        else OptimizerConfig(lr=1e-4, min_lr=1e-5, lr_warmup_fraction=0.04, weight_decay=0.01, clip_grad=1.0)
    )
    distill = DistillConfig(
        drafter=DistillDrafterConfig(
            baseline=baseline,
            transformer_impl="local",
            draft_vocab_size=256 if baseline else 32000,
            aux_layer_ids=TINY_AUX if baseline else None,
        ),
        target=TargetConfig(),
        data=DistillDataConfig(mode="online"),
        ttt=TTTLossConfig(),
        parallel=ParallelConfig(tensor_model_parallel_size=tp),
        training=training,
        optimizer=optimizer,
        checkpoint=CheckpointConfig(save_interval=10),
        logging=_cpu_logging(log_interval=10 if one_process else 1),
    )
    return Recipe(
        name="",
        hardware="cpu",
        precision="fp32",
        chain=("distill",) if baseline else ("adapt", "distill"),
        target="tiny_target",
        source="tiny_source",
        domain=domain,
        budget=f"toy: {training.train_iters} steps",
        paths=tiny_paths(),
        adapt=None if baseline else AdaptConfig(aux_layer_ids=TINY_AUX),
        distill=distill,
        resources={"distill": Resources(gpus_per_node=ranks, cpus_per_task=1, time="00:30:00")},
    )


# --- SmolLM2-135M-Instruct end to end: the smoke chain of the local Slurm cluster ---

SMOKE_DOMAINS = ("chat", "code")


def smollm2_smoke() -> Recipe:
    """Every stage on the real target at smoke size: the backbone is SmolLM2's own first 2 layers."""
    multi = Resources(gpus_per_node=CPU_TASKS, cpus_per_task=1, time="00:20:00", mem="6G")
    single = Resources(cpus_per_task=1, time="00:20:00", mem="6G")
    pretrain = PretrainConfig(
        model=BackboneConfig(transformer_impl="local"),
        training=TrainingConfig(micro_batch_size=1, global_batch_size=2, seq_length=128, train_iters=4),
        optimizer=OptimizerConfig(lr=3e-4, min_lr=3e-5, lr_warmup_iters=1, weight_decay=0.01),
        data=IndexedDataConfig(split="90,10,0"),
        checkpoint=CheckpointConfig(save_interval=2),
        logging=_cpu_logging(eval_interval=1000, eval_iters=1),
    )
    distill = DistillConfig(
        drafter=DistillDrafterConfig(transformer_impl="local"),
        target=TargetConfig(),
        data=DistillDataConfig(mode="offline"),
        ttt=TTTLossConfig(),
        training=TrainingConfig(micro_batch_size=1, global_batch_size=2, seq_length=256, train_iters=4),
        optimizer=OptimizerConfig(lr=1e-4, min_lr=0.0, lr_warmup_fraction=0.25, weight_decay=0.0, clip_grad=1.0),
        checkpoint=CheckpointConfig(save_interval=2),
        logging=_cpu_logging(),
    )
    evaluate = EvaluateConfig(max_new_tokens=16, limit=2, verify_lossless=True, progress=False, seed=0)
    return Recipe(
        name="",
        hardware="cpu",
        precision="fp32",
        chain=("prune", "preprocess", "pretrain", "adapt", "regenerate", "extract", "distill", "export", "evaluate"),
        target="smollm2_135m_instruct",
        source="smollm2_135m_instruct",
        domain="chat",
        eval_domains=list(SMOKE_DOMAINS),
        budget="smoke: 4 pretraining steps, 4 distillation steps",
        paths=Paths(
            root="smollm2_runs",
            source="{root}/models/smollm2",
            target="{root}/models/smollm2",
        ),
        resources={
            "prune": single,
            "preprocess": single,
            "pretrain": multi,
            "adapt": single,
            "regenerate": single,
            "extract": multi,
            "distill": multi,
            "export": single,
            "evaluate": single,
        },
        prune=PruneConfig(num_layers=2, transformer_impl="local"),
        preprocess=PreprocessConfig(workers=1),
        pretrain=pretrain,
        adapt=AdaptConfig(),
        regenerate=RegenerateConfig(
            backend="server", sampling=SamplingParams(temperature=0.0, max_tokens=32), concurrency=4, progress=False
        ),
        extract=ExtractConfig(store=HiddenStateStoreConfig(encoding="bf16"), max_length=256, params_dtype="float32"),
        distill=distill,
        export=ExportConfig(format="sglang"),
        evaluate=evaluate,
        # The eval job serves the target and the drafter in vLLM beside the reference engine where it finds the
        # engine (VLLM_PYTHON, else the checkout's .venv-vllm), and runs the reference engine alone otherwise.
        slurm=Slurm(templates={"evaluate": "eval_vllm"}),
        servers=ServerPool(batch_sizes=[1, 4]),
    )


def smollm2_opd_smoke() -> Recipe:
    """Draft-OPD after the smoke chain: its distilled drafter (paths.sft) rolls out 4 of its regenerated prompts on
    the Megatron-Core target over 2 gloo ranks, then 2 on-policy updates over 2 ranks, export and evaluation."""
    from megatron_osprey.stages.rollout import RolloutConfig

    recipe = smollm2_smoke()
    smoke_run = "{root}/smollm2_cpu_smoke_chat"  # the smoke recipe's run directory under the same root
    recipe.paths.sft = f"{smoke_run}/distill"
    recipe.paths.conversations = f"{smoke_run}/regenerate/conversations.jsonl"
    steps = 3
    recipe.rollout = RolloutConfig(
        steps=steps, top_k=16, max_new_tokens=16, limit=4, samples_per_shard=2, target_backend="megatron"
    )
    recipe.distill.data = DistillDataConfig(mode="on-policy", opd_form="offline")  # the rollout stage's store
    recipe.distill.ttt.ttt_steps = steps
    recipe.distill.training.train_iters = 2
    recipe.distill.optimizer.lr /= 10
    recipe.resources["rollout"] = dataclasses.replace(recipe.resources["distill"])  # its own, for --set
    recipe.chain, recipe.budget = ("rollout", "distill", "export", "evaluate"), "smoke: 4 rollouts, 2 on-policy steps"
    recipe.prune = recipe.preprocess = recipe.pretrain = recipe.adapt = recipe.regenerate = recipe.extract = None
    return recipe


# --- Stage 2 on one language's text: the monolingual fine-tuning strategy for multilingual drafting ---

# Languages of the pinned chatterbot corpus wheel other than English (the demo's multilingual domain); their text
# is written by `python -m megatron_osprey.demo.monolingual --language L --output PATHS.PRETRAIN_TEXT`.
MONOLINGUAL_LANGUAGES = ("spanish", "french", "german", "italian", "portuguese")


def smollm2_monolingual_pretrain(language: str) -> Recipe:
    """prune -> preprocess -> pretrain of SmolLM2's first 2 layers on one language's text, at CPU size."""
    if language not in MONOLINGUAL_LANGUAGES:
        raise ValueError(
            f"language {language!r} has no corpus here; expected one of {', '.join(MONOLINGUAL_LANGUAGES)}."
        )
    multi = Resources(gpus_per_node=CPU_TASKS, cpus_per_task=1, time="00:20:00", mem="6G")
    single = Resources(cpus_per_task=1, time="00:20:00", mem="6G")
    pretrain = PretrainConfig(
        model=BackboneConfig(transformer_impl="local"),
        training=TrainingConfig(micro_batch_size=1, global_batch_size=2, seq_length=128, train_iters=20),
        optimizer=OptimizerConfig(lr=3e-4, min_lr=3e-5, lr_warmup_iters=2, weight_decay=0.01),
        data=IndexedDataConfig(split="90,10,0"),
        checkpoint=CheckpointConfig(save_interval=10),
        logging=_cpu_logging(eval_interval=10, eval_iters=1),
    )
    return Recipe(
        name="",
        hardware="cpu",
        precision="fp32",
        chain=("prune", "preprocess", "pretrain"),
        source="smollm2_135m_instruct",
        budget=f"CPU: 20 steps of 2 x 128 tokens on the {language} chatterbot text, sized for 2 cores",
        paths=Paths(
            root="smollm2_runs",
            source="{root}/models/smollm2",
            pretrain_text=f"{{root}}/data/monolingual/{language}.jsonl",
        ),
        resources={"prune": single, "preprocess": single, "pretrain": multi},
        prune=PruneConfig(num_layers=2, transformer_impl="local"),
        preprocess=PreprocessConfig(workers=1),
        pretrain=pretrain,
    )
