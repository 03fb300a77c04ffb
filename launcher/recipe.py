"""The Recipe dataclass: a target x stage x hardware x precision, with its layout, training and paths."""

from __future__ import annotations

import dataclasses
import math

from launcher.shapes import ModelShape

STAGES = ("prune", "preprocess", "pretrain", "adapt", "regenerate", "extract", "distill", "eval", "export", "demo")
HARDWARE = ("h100", "b200", "cpu")
# Usable memory per device in GiB as the driver reports it (H100 SXM 80 GB, B200 192 GB).
GPU_MEMORY_GIB = {"h100": 79.6, "b200": 179.0}
# The five train/eval domains of the 5x5 acceptance-length matrix.
DOMAINS = ("chat", "code", "math", "science", "multilingual")


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
    eval_domains: list[str] = dataclasses.field(default_factory=lambda: list(DOMAINS))


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
            raise ValueError(f"recipe {self.name}: MXFP8 needs Blackwell (b200); a {self.hardware.upper()} has no "
                             f"MXFP8 GEMMs: use precision fp8 or bf16.")
        if self.drafter.method not in ("osprey", "eagle3"):
            raise ValueError(f"recipe {self.name}: drafter.method must be osprey or eagle3, got {self.drafter.method!r}.")
        if self.drafter.mode not in ("online", "offline"):
            raise ValueError(f"recipe {self.name}: drafter.mode must be online or offline, got {self.drafter.mode!r}.")
        if self.data.hidden_state_encoding not in ("bf16", "int8"):
            raise ValueError(f"recipe {self.name}: data.hidden_state_encoding must be bf16 or int8.")
        if self.data.export_format not in ("sglang", "hf", "speculators"):
            raise ValueError(f"recipe {self.name}: data.export_format must be sglang, hf or speculators.")
        for key in ("nodes", "gpus_per_node", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                    "expert_model_parallel_size", "context_parallel_size", "target_tensor_model_parallel_size",
                    "target_pipeline_model_parallel_size", "target_expert_model_parallel_size"):
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
