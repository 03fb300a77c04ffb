"""The Recipe: a target x stage chain x hardware x precision, as the stages' own configs plus a launch section.

A recipe holds the very config dataclass each of its stages runs (stages/X.py's Config) with every setting but
the paths; `Recipe.config(stage, run_dir)` returns that config with the paths of one run directory filled in
(recipes/layout.py: each stage reads what the stage before it wrote). Beside the configs, the launch section
holds only what a stage cannot know: nodes, GPUs and time per job, the Slurm account and container, the
server pool, and the external inputs (the source LM, the target, the text and prompts).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from megatron_osprey.base.hardware import GPU_CAPABILITY, fp8_recipe_refusal
from megatron_osprey.data.user_data import DOMAIN_NAME, UserDataConfig
from megatron_osprey.stages.adapt import AdaptConfig
from megatron_osprey.stages.distill import DistillConfig
from megatron_osprey.stages.evaluate import EvaluateConfig
from megatron_osprey.stages.export import ExportConfig
from megatron_osprey.stages.extract import ExtractConfig
from megatron_osprey.stages.preprocess import PreprocessConfig
from megatron_osprey.stages.pretrain import PretrainConfig
from megatron_osprey.stages.prune import PruneConfig
from megatron_osprey.stages.regenerate import RegenerateConfig
from megatron_osprey.stages.rollout import RolloutConfig

# The pipeline's stages in chain order.
STAGES = (
    "prune", "preprocess", "pretrain", "adapt", "regenerate", "extract", "rollout", "distill", "export", "evaluate"
)  # fmt: skip
HARDWARE = ("h100", "b200", "cpu")
SERVER_ENGINES = ("sglang", "vllm", "local")
# Usable memory per device in GiB as the driver reports it (H100 SXM 80 GB, B200 192 GB).
GPU_MEMORY_GIB = {"h100": 79.6, "b200": 179.0}
# Host memory of one 8-GPU node in GiB: NVIDIA's DGX H100 and DGX B200 datasheets both give 2 TB (the B200 may be
# configured with 4 TB; this assumes the base figure).
NODE_MEMORY_GIB = {"h100": 2048, "b200": 2048}
# CPUs one GPU node gives Slurm jobs: the smallest of the common 8-GPU nodes (cloud H100 nodes with 96 vCPUs;
# a DGX gives 224 threads). A task's default CPUs are the node's share per GPU; `--set slurm.cpus_per_node=N`
# states another node, and `osprey plan` refuses a stage that asks more of one node than it has.
NODE_CPUS = {"h100": 96, "b200": 96}
NODE_GPUS = 8
DEFAULT_CPUS_PER_TASK = 16  # where the node is not known (hardware cpu)
# Stages that run one process per GPU (or per CPU task) with torch.distributed.
DISTRIBUTED_STAGES = ("prune", "pretrain", "adapt", "extract", "rollout", "distill")


def whole_node_mem(hardware: str) -> str:
    """The memory a job that holds a whole GPU node asks for: 3/4 of NODE_MEMORY_GIB.

    A node's schedulable memory (Slurm's RealMemory) sits below the physical figure, and other vendors' and the
    clouds' 8-GPU nodes carry 1.8-1.9 TB, so a job asking for all 2 TB would be refused. Change it with
    `--set resources.STAGE.mem=...` (Slurm units: 1536G, 1T).
    """
    return f"{NODE_MEMORY_GIB[hardware] * 3 // 4}G"


@dataclasses.dataclass
class Resources:
    """One stage's job: nodes, processes (GPUs) per node, array tasks, CPUs, time."""

    nodes: int = 1
    gpus_per_node: int = 1  # also the tasks per node of a distributed stage
    array_tasks: int = 1  # > 1: a Slurm array (preprocess files, extract shards)
    cpus_per_task: int | None = None  # None: the node's CPUs per GPU (Recipe.stage_resources)
    time: str = "04:00:00"
    mem: str | None = None  # per node (#SBATCH --mem), e.g. 64G; None: the partition's default

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclasses.dataclass
class Slurm:
    """Scheduler settings; partition, account and container image may also come from the environment."""

    partition: str | None = None
    account: str | None = None
    container_image: str | None = None
    container_mounts: str | None = None
    cpus_per_node: int | None = None  # None: NODE_CPUS of the recipe's hardware
    templates: dict[str, str] = dataclasses.field(default_factory=dict)  # stage -> template name override


@dataclasses.dataclass
class ServerPool:
    """The servers a regenerate or evaluate job starts, each engine in its own environment (SGLANG_PYTHON,
    VLLM_PYTHON)."""

    # sglang, vllm or local (tools/serve_local.py); None: SGLang on GPUs, on CPU vLLM where the job finds it
    engine: str | None = None
    servers: int = 1
    tensor_parallel_size: int = 1
    port: int = 30000
    startup_timeout: int = 1800  # seconds until every server answers /health
    reasoning_parser: str | None = None  # the engine's --reasoning-parser (qwen3, minimax-append-think)
    context_length: int | None = None  # None: the model's
    # SGLang server flags the release passes (scripts/osprey/regenerate_data.sh, examples/minimax-m25/eval.sh):
    trust_remote_code: bool = False  # --trust-remote-code on the regeneration servers (the release: every target)
    eval_trust_remote_code: bool = False  # --trust-remote-code on the eval server (the release: MiniMax-M2.5)
    expert_parallel_size: int = 1  # the eval server's --ep-size (an MoE target's experts over its GPUs)
    disable_custom_all_reduce: bool = False  # the eval server's --disable-custom-all-reduce (an FP8 MoE target)
    batch_sizes: list[int] = dataclasses.field(default_factory=lambda: [1, 16])  # eval_sglang's / eval_vllm's sweep

    def sglang_flags(self, evaluation: bool) -> list[str]:
        """The SGLang server flags of a regeneration (`evaluation` False) or an eval server, beyond model and TP."""
        trust = self.eval_trust_remote_code if evaluation else self.trust_remote_code
        flags = ["--trust-remote-code"] if trust else []
        if evaluation and self.expert_parallel_size > 1:
            flags += ["--ep-size", str(self.expert_parallel_size)]
        if evaluation and self.disable_custom_all_reduce:
            flags.append("--disable-custom-all-reduce")
        return flags


@dataclasses.dataclass
class Paths:
    """External inputs and the run directory; {root}, {name}, {target}, {source} and {domain} are filled in."""

    root: str = "osprey_runs"
    run_dir: str = "{root}/{name}"
    source: str = "{root}/models/{source}"  # the HF small LM the prune stage cuts
    pretrain_text: str = "{root}/data/pretrain_text.jsonl"  # preprocess --input: a file or a directory of shards
    backbone: str = "{root}/backbone"  # adapt's input when the chain has no pretrain (a pretrained backbone)
    target: str = "{root}/models/{target}"  # the target's HF directory (config.json suffices to plan)
    prompts: str = "{root}/data/prompts/{domain}.jsonl"  # regenerate --input
    conversations: str = "{root}/data/{target}/{domain}.jsonl"  # when the chain has no regenerate
    eval_data: str = "{root}/data/eval/{domain}.jsonl"  # one split per eval domain
    token_counts: str | None = None  # adapt's reduced draft vocabulary (osprey data writes it)
    sft: str = "{root}/sft/{target}_{domain}"  # Draft-OPD's start: an SFT-distilled drafter (a distill run's output)


@dataclasses.dataclass
class Recipe:
    """Everything one chain of stages needs: the stages' configs, the launch section and the external inputs."""

    name: str
    hardware: str
    precision: str
    chain: tuple[str, ...]  # the stages `osprey pipeline` runs, in order
    target: str | None = None  # target preset name: {target} in paths, the plan's shape without a config.json
    source: str | None = None  # source LM preset name: {source} in paths, the prune stage's shape
    domain: str | None = None  # the training domain of per-domain recipes
    eval_domains: list[str] = dataclasses.field(default_factory=list)
    # Eval sets that are public benchmark suites (`osprey suite`): name -> prompts, each set written with exactly that
    # many (the first ones, as the release's benchmark takes them) at paths.eval_data; `osprey plan` lists the commands.
    eval_suites: dict[str, int] = dataclasses.field(default_factory=dict)
    budget: str = ""  # where the training length comes from (paper, release, or neither), for `osprey plan`
    paths: Paths = dataclasses.field(default_factory=Paths)
    # The input rule: the `osprey data` run that builds paths.prompts / paths.eval_data from a source file (its split
    # rule, seed and sizes; the source and the output are the user's). `osprey plan` prints the command.
    data: UserDataConfig | None = None
    slurm: Slurm = dataclasses.field(default_factory=Slurm)
    servers: ServerPool = dataclasses.field(default_factory=ServerPool)
    resources: dict[str, Resources] = dataclasses.field(default_factory=dict)
    prune: PruneConfig | None = None
    preprocess: PreprocessConfig | None = None
    pretrain: PretrainConfig | None = None
    adapt: AdaptConfig | None = None
    regenerate: RegenerateConfig | None = None
    extract: ExtractConfig | None = None
    rollout: RolloutConfig | None = None
    distill: DistillConfig | None = None
    export: ExportConfig | None = None
    evaluate: EvaluateConfig | None = None

    def validate(self) -> None:
        """Raise one clear sentence for a field outside its allowed values."""
        for key, value in [("domain", self.domain)] + [("eval_domains", d) for d in self.eval_domains]:
            if value is not None:
                check_domain_name(value, f"recipe {self.name}: {key}")
        if self.hardware not in HARDWARE:
            raise ValueError(f"recipe {self.name}: hardware {self.hardware!r} is not one of {', '.join(HARDWARE)}.")
        self._refuse_fp8_the_gpu_lacks()
        if self.servers.engine is not None and self.servers.engine not in SERVER_ENGINES:
            raise ValueError(
                f"recipe {self.name}: servers.engine {self.servers.engine!r} is not one of {', '.join(SERVER_ENGINES)} "
                "(or unset: SGLang on GPUs, vLLM on CPU where the job finds it)."
            )
        for stage in self.chain:
            if stage not in STAGES:
                raise ValueError(f"recipe {self.name}: chain stage {stage!r} is not one of {', '.join(STAGES)}.")
            if getattr(self, stage) is None:
                raise ValueError(f"recipe {self.name}: its chain runs {stage} but it has no {stage} config.")
        if self.servers.expert_parallel_size < 1:
            raise ValueError(f"recipe {self.name}: servers.expert_parallel_size must be at least 1.")
        for suite, prompts in self.eval_suites.items():
            if suite not in self.eval_domains or not isinstance(prompts, int) or prompts < 1:
                raise ValueError(
                    f"recipe {self.name}: eval_suites.{suite} = {prompts!r} must name one of its eval_domains "
                    f"({', '.join(self.eval_domains)}) with a number of prompts of at least 1."
                )
        for stage, res in self.resources.items():
            for key in ("nodes", "gpus_per_node", "array_tasks", "cpus_per_task"):
                if getattr(res, key) is not None and int(getattr(res, key)) < 1:
                    raise ValueError(f"recipe {self.name}: resources.{stage}.{key} must be at least 1.")

    def _refuse_fp8_the_gpu_lacks(self) -> None:
        """A stage whose FP8 recipe has no GEMMs on the recipe's GPU type is refused before any job starts."""
        capability = GPU_CAPABILITY.get(self.hardware)
        if capability is None:
            return
        for stage in STAGES:
            model = getattr(getattr(self, stage), "model", None)
            if getattr(model, "fp8_format", None) is None:
                continue
            refusal = fp8_recipe_refusal(model.fp8_recipe, capability, f"its hardware {self.hardware.upper()}")
            if refusal:
                raise ValueError(f"recipe {self.name} ({stage}.model.fp8_recipe): {refusal}")

    @property
    def run_name(self) -> str:
        """The recipe name, with the domain appended for per-domain runs (job names, run directories)."""
        return f"{self.name}_{self.domain}" if self.domain else self.name

    def path(self, key: str, domain: str | None = None) -> str:
        """paths.<key> with its placeholders filled in (`domain` for another domain's file)."""
        template = getattr(self.paths, key)
        if template is None:
            return None
        values = {
            "root": self.paths.root,
            "name": self.run_name,
            "target": self.target or "no_target",
            "source": self.source or "no_source",
            "domain": domain or self.domain or "all",
        }
        try:
            return str(template).format(**values)
        except (KeyError, IndexError, ValueError):
            raise ValueError(
                f"recipe {self.name}: paths.{key} = {template!r} uses a placeholder other than "
                f"{{root}}, {{name}}, {{target}}, {{source}}, {{domain}}."
            ) from None

    @property
    def cpus_per_node(self) -> int | None:
        """The CPUs one node of the recipe's hardware gives a job (slurm.cpus_per_node, else NODE_CPUS)."""
        return self.slurm.cpus_per_node or NODE_CPUS.get(self.hardware)

    def tasks_per_node(self, stage: str) -> int:
        """The Slurm tasks the stage's job runs on one node: one per GPU for a distributed stage, one per server
        for regeneration (the node's GPUs over each server's TP), else one."""
        if stage == "regenerate":
            return max(1, NODE_GPUS // self.servers.tensor_parallel_size) if self.hardware != "cpu" else 1
        return (self.resources.get(stage) or Resources()).gpus_per_node if stage in DISTRIBUTED_STAGES else 1

    def stage_resources(self, stage: str) -> Resources:
        """The job resources of `stage` (one process on one node unless the recipe says otherwise); where the
        recipe leaves its CPUs per task unset, each task gets the node's CPUs in proportion to its GPUs."""
        res = copy.copy(self.resources.get(stage) or Resources())
        if res.cpus_per_task is None:
            node = self.cpus_per_node
            gpus = NODE_GPUS if stage == "regenerate" else res.gpus_per_node
            per_task = max(1, gpus // self.tasks_per_node(stage))
            res.cpus_per_task = max(1, node * per_task // NODE_GPUS) if node else DEFAULT_CPUS_PER_TASK
        return res

    def config(self, stage: str, run_dir: str | None = None) -> Any:
        """The config `stage` runs, its paths those of `run_dir` (default: paths.run_dir)."""
        from megatron_osprey.recipes.layout import wire_paths

        base = getattr(self, stage, None) if stage in STAGES else None
        if base is None:
            has = ", ".join(s for s in STAGES if getattr(self, s) is not None)
            raise ValueError(f"recipe {self.name} has no {stage} stage; it has: {has}.")
        config = copy.deepcopy(base)
        wire_paths(self, stage, config, run_dir or self.path("run_dir"))
        return config


def check_domain_name(value: Any, where: str) -> None:
    """Refuse a domain that could leave the run directory or a job name (`/`, `..`, a leading dot): it names files
    ({root}/data/prompts/{domain}.jsonl), Slurm jobs and their logs."""
    if not (isinstance(value, str) and DOMAIN_NAME.match(value)):
        raise ValueError(
            f"{where} {value!r} is not a domain name: letters, digits, '_', '-' or '.', starting with a letter or "
            f"digit (it names files, jobs and logs in the run directory)."
        )
