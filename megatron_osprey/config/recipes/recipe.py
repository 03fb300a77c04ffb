"""The Recipe: a target x stage x hardware x precision; its stage config plus a launch section.

`Recipe.config()` is the config the stage's entry point runs from (PretrainConfig for pretrain,
DistillConfig for distill), built here and nowhere else: the `osprey` launcher renders it as the
entry point's flags and the entry points' `--recipe NAME` returns it, so the two cannot disagree.
The launch section (layout, paths, Slurm, the data tools' settings, model shapes for planning)
drives the other stages' tools and the scheduler.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Union

from megatron_osprey.config.distill import DistillConfig
from megatron_osprey.config.pretrain import PretrainConfig
from megatron_osprey.config.recipes.shapes import ModelShape
from megatron_osprey.parallel import ParallelConfig

STAGES = ("prune", "preprocess", "pretrain", "adapt", "regenerate", "extract", "distill", "eval", "export", "demo")
HARDWARE = ("h100", "b200", "cpu")
# Usable memory per device in GiB as the driver reports it (H100 SXM 80 GB, B200 192 GB).
GPU_MEMORY_GIB = {"h100": 79.6, "b200": 179.0}
# The five train/eval domains of the 5x5 acceptance-length matrix.
RECIPE_DOMAINS = ("chat", "code", "math", "science", "multilingual")


@dataclasses.dataclass
class Layout:
    """Where the processes go and how the trained model (and the frozen target) are split."""

    nodes: int = 1
    gpus_per_node: int = 1
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    target_tensor_model_parallel_size: int = 1
    target_pipeline_model_parallel_size: int = 1
    target_expert_model_parallel_size: int = 1
    # None: Megatron's default (= target TP); MoE targets with EP over all GPUs need 1.
    target_expert_tensor_parallel_size: int | None = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclasses.dataclass
class Training:
    """Megatron-LM training flags; defaults are the paper's adaptation settings."""

    micro_batch_size: int = 1
    global_batch_size: int = 16
    seq_length: int = 4096
    train_iters: int | None = None  # None: epochs x num_examples / global_batch_size
    epochs: int = 3
    num_examples: int = 65_000
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_warmup_fraction: float | None = 0.04
    lr_warmup_iters: int | None = None
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    bf16: bool = True
    fp8_format: str | None = None  # hybrid / e4m3 for the trained model's GEMMs
    fp8_recipe: str | None = None  # delayed / tensorwise (H100), mxfp8 (B200)
    transformer_impl: str = "transformer_engine"
    use_distributed_optimizer: bool = True
    save_interval: int = 1000
    eval_interval: int = 1000
    eval_iters: int = 10  # validation batches per evaluation (pretraining only)
    log_interval: int = 10
    wandb_project: str | None = "osprey"
    seed: int = 1234

    def iterations(self) -> int:
        """train_iters, or enough iterations for `epochs` passes over `num_examples`."""
        if self.train_iters is not None:
            return self.train_iters
        return math.ceil(self.epochs * self.num_examples / self.global_batch_size)

    def warmup_iters(self) -> int:
        """Warm-up iterations from lr_warmup_iters or lr_warmup_fraction."""
        if self.lr_warmup_iters is not None:
            return self.lr_warmup_iters
        return round((self.lr_warmup_fraction or 0.0) * self.iterations())


@dataclasses.dataclass
class Drafter:
    """What Stage 3/4 build and train: an Osprey drafter or the EAGLE-3 baseline."""

    method: str = "osprey"  # or "eagle3"
    mode: str = "online"  # online: frozen target in the loop; offline: extracted hidden states
    domain: str | None = None
    num_layers: int = 2
    ttt_steps: int = 5  # both arms in the paper's matched comparison
    aux_layer_ids: list[int] | None = None  # None: [1, L//2 - 1, L - 4]
    draft_vocab_size: int | None = None  # EAGLE-3 baseline: 32,000
    target_fp8_format: str | None = None  # FP8 for the frozen target forward
    target_fp8_recipe: str | None = None
    eval_domains: list[str] = dataclasses.field(default_factory=lambda: list(RECIPE_DOMAINS))


@dataclasses.dataclass
class Data:
    """Data-tool settings: preprocessing, regeneration, extraction."""

    preprocess_workers: int = 32
    preprocess_files: int = 1  # array tasks: one per line of paths.pretrain_text
    tokenizer_json_key: str = "text"
    split: str = "969,30,1"
    regenerate_servers: int = 1  # SGLang servers in the pool
    regenerate_server_tensor_parallel_size: int = 8
    regenerate_server_urls: list[str] = dataclasses.field(default_factory=list)  # local runs
    regenerate_temperature: float = 0.0
    regenerate_max_tokens: int = 4096
    regenerate_concurrency: int = 64
    extract_shards: int = 1  # array tasks
    hidden_state_encoding: str = "bf16"  # or int8
    export_format: str = "sglang"  # sglang / hf / speculators
    eval_steps: int = 5
    eval_topk: int = 1
    eval_draft_tokens: int = 6


@dataclasses.dataclass
class Paths:
    """Inputs and outputs; {root}, {name}, {target} and {domain} are filled in when resolved."""

    root: str = "osprey_runs"
    source: str = "{root}/models/qwen3_4b"
    backbone: str = "{root}/backbone/qwen3_4b_2layer"
    pretrain_text: str = "{root}/data/fineweb/files.txt"
    pretrain_data: str = "{root}/data/fineweb/fineweb"  # preprocess --output-prefix
    tokenizer: str = "{root}/models/qwen3_4b"
    target: str = "{root}/models/{target}"
    prompts: str = "{root}/data/prompts/{domain}.jsonl"
    conversations: str = "{root}/data/{target}/{domain}.jsonl"
    token_counts: str = "{root}/data/{target}/token_counts.json"
    hidden_states: str = "{root}/hidden_states/{target}/{domain}"
    drafter_init: str = "{root}/drafter_init/{target}"
    save: str = "{root}/checkpoints/{name}"
    eval_data: str = "{root}/data/eval/{domain}.jsonl"
    eval_output: str = "{root}/eval/{name}"
    export: str = "{root}/export/{name}"
    demo_output: str = "demo_out"
    logs: str = "{root}/logs"


@dataclasses.dataclass
class Slurm:
    """Scheduler settings; partition, account and container image may also come from the environment."""

    time: str = "04:00:00"
    partition: str | None = None
    account: str | None = None
    container_image: str | None = None
    container_mounts: str | None = None
    cpus_per_task: int = 16
    templates: dict[str, str] = dataclasses.field(default_factory=dict)  # stage -> template name override


@dataclasses.dataclass
class Recipe:
    """Everything one pipeline run needs: shapes, layout, hyper-parameters, paths, scheduler."""

    name: str
    stage: str  # the stage `osprey plan` / `osprey submit` use by default
    hardware: str
    precision: str
    model: ModelShape | None = None  # the model this recipe trains (backbone; Stage 1 source for prune)
    target: ModelShape | None = None  # the frozen target
    source: ModelShape | None = None  # the HF LM Stage 1 prunes
    layout: Layout = dataclasses.field(default_factory=Layout)
    training: Training = dataclasses.field(default_factory=Training)
    drafter: Drafter = dataclasses.field(default_factory=Drafter)
    data: Data = dataclasses.field(default_factory=Data)
    paths: Paths = dataclasses.field(default_factory=Paths)
    slurm: Slurm = dataclasses.field(default_factory=Slurm)
    extra_args: list[str] = dataclasses.field(default_factory=list)  # appended to the entry point's flags

    def validate(self) -> None:
        """Raise one clear sentence for a field outside its allowed values."""
        if self.stage not in STAGES:
            raise ValueError(f"recipe {self.name}: stage {self.stage!r} is not one of {', '.join(STAGES)}.")
        if self.hardware not in HARDWARE:
            raise ValueError(f"recipe {self.name}: hardware {self.hardware!r} is not one of {', '.join(HARDWARE)}.")
        if self.precision == "mxfp8" and self.hardware != "b200":
            raise ValueError(
                f"recipe {self.name}: MXFP8 needs Blackwell (b200); a {self.hardware.upper()} has no "
                f"MXFP8 GEMMs: use precision fp8 or bf16."
            )
        if self.drafter.method not in ("osprey", "eagle3"):
            raise ValueError(
                f"recipe {self.name}: drafter.method must be osprey or eagle3, got {self.drafter.method!r}."
            )
        if self.drafter.mode not in ("online", "offline"):
            raise ValueError(f"recipe {self.name}: drafter.mode must be online or offline, got {self.drafter.mode!r}.")
        if self.data.hidden_state_encoding not in ("bf16", "int8"):
            raise ValueError(f"recipe {self.name}: data.hidden_state_encoding must be bf16 or int8.")
        if self.data.export_format not in ("sglang", "hf", "speculators"):
            raise ValueError(f"recipe {self.name}: data.export_format must be sglang, hf or speculators.")
        for key in (
            "nodes",
            "gpus_per_node",
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "expert_model_parallel_size",
            "context_parallel_size",
            "target_tensor_model_parallel_size",
            "target_pipeline_model_parallel_size",
            "target_expert_model_parallel_size",
        ):
            if int(getattr(self.layout, key)) < 1:
                raise ValueError(f"recipe {self.name}: layout.{key} must be at least 1.")

    @property
    def run_name(self) -> str:
        """The recipe name, with the domain appended for per-domain runs (job names, checkpoint dirs)."""
        return f"{self.name}_{self.drafter.domain}" if self.drafter.domain else self.name

    def resolved_paths(self) -> dict[str, str]:
        """Paths with {root}, {name} (the run name), {target} and {domain} substituted."""
        fields = {f.name: getattr(self.paths, f.name) for f in dataclasses.fields(Paths)}
        values = {
            "root": fields["root"],
            "name": self.run_name,
            "target": self.target.name if self.target else "no_target",
            "domain": self.drafter.domain or "all",
        }
        out = {}
        for key, template in fields.items():
            try:
                out[key] = str(template).format(**values)
            except (KeyError, IndexError, ValueError):
                raise ValueError(
                    f"recipe {self.name}: paths.{key} = {template!r} uses a placeholder other than "
                    f"{{root}}, {{name}}, {{target}}, {{domain}}."
                ) from None
        return out

    def domain_path(self, key: str, domain: str) -> str:
        """paths.<key> resolved for another domain (the eval matrix reads every domain)."""
        return dataclasses.replace(self, drafter=dataclasses.replace(self.drafter, domain=domain)).resolved_paths()[key]

    def config(self, stage: str | None = None, *, paths: bool = True) -> Union[PretrainConfig, DistillConfig]:
        """The config `stage`'s entry point runs from (default: the recipe's stage); paths=False leaves every
        file and directory unset."""
        stage = stage or self.stage
        if stage == "pretrain":
            return _pretrain_config(self, paths)
        if stage == "distill":
            return _distill_config(self, paths)
        raise ValueError(f"recipe {self.name}: stage {stage} has no training config (pretrain and distill have).")


def pretrain_data_prefixes(recipe: Recipe) -> list[str]:
    """The indexed-dataset prefixes Stage 2 reads: one per preprocessing array task."""
    prefix = recipe.resolved_paths()["pretrain_data"]
    key = recipe.data.tokenizer_json_key
    if recipe.data.preprocess_files == 1:
        return [f"{prefix}_{key}_document"]
    return [f"{prefix}_{i:05d}_{key}_document" for i in range(recipe.data.preprocess_files)]


def shared_tensor_parallel(recipe: Recipe) -> tuple[int, bool]:
    """(TP size, sequence parallel) of distillation: drafter and target share one TP group, the larger size wins.

    A MoE target at TP > 1 also needs sequence parallelism (Megatron-Core's MoE with TP).
    """
    lay = recipe.layout
    size = max(lay.tensor_model_parallel_size, lay.target_tensor_model_parallel_size)
    return size, lay.sequence_parallel or bool(recipe.target and recipe.target.num_experts and size > 1)


def _common(recipe: Recipe, cfg, parallel: ParallelConfig, paths: bool):
    """The sections pretraining and distillation share: batch, schedule, checkpoints, logging."""
    t = recipe.training
    cfg.parallel = parallel
    cfg.training.micro_batch_size, cfg.training.global_batch_size = t.micro_batch_size, t.global_batch_size
    cfg.training.seq_length, cfg.training.train_iters = t.seq_length, t.iterations()
    opt = cfg.optimizer
    opt.lr, opt.min_lr, opt.lr_warmup_iters, opt.lr_decay_style = t.lr, t.min_lr, t.warmup_iters(), t.lr_decay_style
    opt.weight_decay, opt.clip_grad, opt.use_distributed_optimizer = (
        t.weight_decay,
        t.clip_grad,
        t.use_distributed_optimizer,
    )
    cfg.logging.log_interval, cfg.logging.wandb_project = t.log_interval, t.wandb_project
    if paths:
        save = recipe.resolved_paths()["save"]
        cfg.checkpoint.save_interval = t.save_interval
        # --load is the --save directory: a requeued job resumes from its own latest checkpoint.
        cfg.checkpoint.save = cfg.checkpoint.load = save
        cfg.training.exit_signal_handler = True
        cfg.logging.tensorboard_dir = f"{save}/tensorboard"
        if t.wandb_project:
            cfg.logging.wandb_exp_name = recipe.run_name
    return cfg


def _pretrain_config(recipe: Recipe, paths: bool) -> PretrainConfig:
    lay, t = recipe.layout, recipe.training
    parallel = ParallelConfig(
        tensor_model_parallel_size=lay.tensor_model_parallel_size,
        pipeline_model_parallel_size=lay.pipeline_model_parallel_size,
        context_parallel_size=lay.context_parallel_size,
        expert_model_parallel_size=lay.expert_model_parallel_size,
        sequence_parallel=lay.sequence_parallel,
        seed=t.seed,
    )
    cfg = _common(recipe, PretrainConfig(), parallel, paths)
    cfg.model.bf16, cfg.model.transformer_impl = t.bf16, t.transformer_impl
    if t.fp8_format:
        cfg.model.fp8_format, cfg.model.fp8_recipe = t.fp8_format, t.fp8_recipe or "delayed"
    cfg.logging.eval_interval, cfg.logging.eval_iters, cfg.data.split = t.eval_interval, t.eval_iters, recipe.data.split
    if paths:
        cfg.model.backbone = recipe.resolved_paths()["backbone"]
        cfg.data.data_path = pretrain_data_prefixes(recipe)
    return cfg


def _distill_config(recipe: Recipe, paths: bool) -> DistillConfig:
    lay, t, dr = recipe.layout, recipe.training, recipe.drafter
    size, sequence_parallel = shared_tensor_parallel(recipe)
    parallel = ParallelConfig(
        tensor_model_parallel_size=size,
        pipeline_model_parallel_size=lay.pipeline_model_parallel_size,
        context_parallel_size=lay.context_parallel_size,
        sequence_parallel=sequence_parallel,
        seed=t.seed,
    )
    cfg = _common(recipe, DistillConfig(), parallel, paths)
    if t.lr_warmup_iters is None:  # distillation takes the warmup as a fraction of the run itself
        cfg.optimizer.lr_warmup_iters, cfg.lr_warmup_fraction = 0, t.lr_warmup_fraction or 0.0
    cfg.drafter.bf16, cfg.drafter.transformer_impl = t.bf16, t.transformer_impl
    if dr.method == "eagle3":
        # The draft vocabulary is the training data's top-K assistant tokens, counted by distill itself;
        # Osprey's aux taps come with its Stage 3 output.
        cfg.drafter.baseline, cfg.drafter.eagle3_num_layers = "eagle3", dr.num_layers
        if dr.draft_vocab_size:
            cfg.drafter.draft_vocab_size = dr.draft_vocab_size
        if dr.aux_layer_ids:
            cfg.drafter.aux_layer_ids = list(dr.aux_layer_ids)
    target = cfg.target
    target.mode = dr.mode
    target.tensor_model_parallel_size = lay.target_tensor_model_parallel_size
    target.pipeline_model_parallel_size = lay.target_pipeline_model_parallel_size
    target.expert_model_parallel_size = lay.target_expert_model_parallel_size
    target.expert_tensor_parallel_size = lay.target_expert_tensor_parallel_size
    target.fp8_format, target.fp8_recipe = dr.target_fp8_format, dr.target_fp8_recipe
    cfg.ttt.ttt_steps, cfg.data.domain = dr.ttt_steps, dr.domain
    if paths:
        p = recipe.resolved_paths()
        target.target = p["target"]
        if dr.method != "eagle3":
            cfg.drafter.drafter_init = p["drafter_init"]
        if dr.mode == "online":
            cfg.data.data_path = [p["conversations"]]
        else:
            target.hidden_states = p["hidden_states"]
    return cfg
