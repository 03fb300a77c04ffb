"""`osprey plan`: check a recipe's stage layout and size it (world, memory per GPU, steps, tokens, disk), torch-free.

The numbers come from the very config the stage runs (`Recipe.config(stage)`), and the checks are the stage's own:
`validate_training` (batch divisibility, lengths) and `ModelArch.validate_parallel` (sizes divide heads, layers,
experts). Shapes come from the models' config.json where paths.target / paths.source hold one, else the recipe's
named preset.

Memory model (estimates that catch layouts which cannot fit, not a profiler):
- trained model, per GPU, with P/(TP*PP) parameters: BF16 weights (2 bytes), FP32 main grads (4) and Adam states with
  FP32 master weights (12), the last divided by DP under the distributed optimizer; float32 runs: 4 + 4 + 8.
- activations: 34 * s * b * h bytes per layer and micro-batch (Korthikanti et al. 2022, flash attention, no
  recomputation), divided by TP under sequence parallelism, times the TTT steps for distillation, plus the LM-head
  logits and the TTT loss (megatron_osprey.base.memory.ttt_logits_bytes: every step's logits, the float32 target
  logits, one logits gradient and the loss's float32 chunk, measured); under pipeline parallelism the first stage
  holds PP micro-batches.
- TTT attention (distillation): megatron_osprey.base.memory.ttt_attention_bytes per layer (measured in bf16).
- frozen target: megatron_osprey.base.memory.estimate_target_memory (weights / (TP*PP*EP) and prefill activations).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

from launcher.node import node_check
from launcher.plan_moe import moe_nodes_needed
from launcher.plan_report import data_rule, eval_suite_commands, plan_lines, training_budget
from megatron_osprey.base.arch import ModelArch, hf_config_file, resolve_aux_layer_ids
from megatron_osprey.base.hardware import FP8_RECIPE_CUDA, GPU_CAPABILITY, CpuCapability, fp8_recipe_refusal
from megatron_osprey.base.memory import (
    GIB,
    RUNTIME_RESERVE_BYTES,
    estimate_target_memory,
    parallel_sizes,
    target_head_bytes,
    ttt_attention_bytes,
    ttt_logits_bytes,
)
from megatron_osprey.models.backbone.gpu_support import refuse_without_transformer_engine
from megatron_osprey.models.drafter.arch import DrafterArch, eagle3_body
from megatron_osprey.recipes.backbone import BACKBONE_LAYERS
from megatron_osprey.recipes.distill import EAGLE3_DENSE_FFN
from megatron_osprey.recipes.recipe import GPU_MEMORY_GIB, Recipe
from megatron_osprey.recipes.targets import model_arch
from megatron_osprey.training.config import validate_training

TRAINED_STAGES = ("pretrain", "distill")
TARGET_STAGES = ("distill", "extract", "rollout")
# Offline hidden-state stores in int8 take about this share of bf16 (values plus per-row scales).
INT8_STORE_RATIO = 0.45


class LayoutError(ValueError):
    """The recipe's layout cannot run: a parallel size does not divide what it splits, or it does not fit."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """The numbers `osprey plan` prints (and `--json` writes)."""

    recipe: str
    stage: str
    hardware: str
    precision: str
    nodes: int
    gpus_per_node: int
    world_size: int
    data_parallel_size: int
    checks: tuple[str, ...]
    memory: tuple[tuple[str, int], ...]  # (what, bytes per GPU)
    gpu_memory_gib: float | None
    train_iters: int
    global_batch_size: int
    seq_length: int
    disk: tuple[tuple[str, int], ...]
    budget: str = ""
    target: dict | None = None  # the target's shape as planned
    cpu: str | None = None  # a CPU recipe: this machine's capability (CpuCapability.line())
    needs: str | None = None  # a MoE target that does not fit: the nodes it needs (launcher/plan_moe.py)
    schedule: dict | None = None  # a trained stage's learning-rate schedule (OptimizerConfig.schedule)
    eval_suites: dict | None = None  # the recipe's benchmark eval sets: prompts and the command that writes each
    data_rule: dict | None = None  # the recipe's input rule: the `osprey data` settings and command

    @property
    def memory_bytes(self) -> int:
        return sum(b for _, b in self.memory)

    @property
    def tokens(self) -> int:
        return self.train_iters * self.global_batch_size * self.seq_length

    @property
    def fits(self) -> bool:
        return not self.gpu_memory_gib or self.memory_bytes <= self.gpu_memory_gib * GIB

    def to_json(self) -> dict:
        """The plan as one JSON object (scripts and tests read it)."""
        return {
            "recipe": self.recipe,
            "stage": self.stage,
            "hardware": self.hardware,
            "precision": self.precision,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "world_size": self.world_size,
            "data_parallel_size": self.data_parallel_size,
            "target": self.target,
            "cpu": self.cpu,
            "memory_gib_per_gpu": round(self.memory_bytes / GIB, 3),
            "memory_breakdown_gib": {name: round(b / GIB, 3) for name, b in self.memory},
            "gpu_memory_gib": self.gpu_memory_gib,
            "fits": self.fits,
            "train_iters": self.train_iters,
            "global_batch_size": self.global_batch_size,
            "seq_length": self.seq_length,
            "tokens": self.tokens,
            "budget": self.budget,
            "checks": list(self.checks),
            "needs": self.needs,
            "disk_bytes": {name: b for name, b in self.disk},
            "schedule": self.schedule,
            "eval_suites": self.eval_suites,
            "data_rule": self.data_rule,
        }

    def lines(self) -> list[str]:
        """Human-readable report, one fact per line."""
        return plan_lines(self)


def target_arch(recipe: Recipe) -> ModelArch:
    """The target's architecture: its config.json at paths.target, else the recipe's preset (parsed once)."""
    return model_arch(recipe.target, recipe.path("target"), "paths.target")


def backbone_arch(recipe: Recipe) -> ModelArch:
    """The drafter backbone: the source LM's first N blocks (N from the prune stage, else the release's backbone of
    that source: 2 of Qwen3-4B, 4 of LayerSkip-Llama)."""
    layers = recipe.prune.num_layers if recipe.prune is not None else BACKBONE_LAYERS.get(recipe.source, 2)
    return model_arch(recipe.source, recipe.path("source"), "paths.source").with_num_layers(layers)


def eagle3_arch(target: ModelArch, num_layers: int, target_name: str | None) -> ModelArch:
    """EAGLE-3's drafter body (eagle3_body); a MoE preset without mlp_intermediate_size gets the recipe's width."""
    width = EAGLE3_DENSE_FFN.get(target_name or "")
    if target.is_moe and width and not target.hf_config.get("mlp_intermediate_size"):
        target = dataclasses.replace(target, hf_config={**target.hf_config, "mlp_intermediate_size": width})
    return eagle3_body(target, num_layers)


def planned_drafter(recipe: Recipe, config, target: ModelArch | None = None) -> tuple[DrafterArch, int, int]:
    """(the drafter the distill stage builds, its trainable and frozen parameters, DrafterArch.num_parameters)."""
    target = target if target is not None else target_arch(recipe)
    drafter = config.drafter
    common = dict(
        target_hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        aux_layer_ids=(),  # which target layers feed fusion_fc does not change a shape (_target_summary reports them)
        hidden_post_norm=drafter.hidden_post_norm,
        aux_hidden_norm=drafter.aux_hidden_norm,
    )
    if drafter.baseline:
        arch = DrafterArch(
            body=eagle3_arch(target, drafter.eagle3_num_layers, recipe.target),
            draft_vocab_size=min(drafter.draft_vocab_size, target.vocab_size),
            variant="eagle3",
            eagle3_extra_layers=drafter.eagle3_extra_layers,
            **common,
        )
    else:
        draft_vocab = recipe.adapt.draft_vocab_size if recipe.adapt is not None else None
        arch = DrafterArch(body=backbone_arch(recipe), draft_vocab_size=draft_vocab or target.vocab_size, **common)
    return (arch, *arch.num_parameters())


@dataclasses.dataclass(frozen=True)
class _Trained:
    """What the plan needs of the model a training stage trains."""

    arch: ModelArch
    trainable: int
    frozen: int
    vocab: int
    bf16: bool
    ttt_steps: int


def _trained(recipe: Recipe, stage: str, config, target: ModelArch | None) -> _Trained:
    if stage == "pretrain":
        arch = backbone_arch(recipe)
        return _Trained(arch, arch.num_parameters(), 0, arch.vocab_size, config.model.bf16, 1)
    arch, trainable, frozen = planned_drafter(recipe, config, target)
    return _Trained(arch.body, trainable, frozen, arch.draft_vocab_size, config.drafter.bf16, config.ttt.ttt_steps)


def _trained_memory(model: _Trained, config, dp: int) -> list[tuple[str, int]]:
    par, t = config.parallel, config.training
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    shard = math.ceil(model.trainable / (tp * pp))
    weight_bytes, optim_bytes = (2, 12) if model.bf16 else (4, 8)
    optim_shards = dp if config.optimizer.use_distributed_optimizer else 1
    act_bytes = 2 if model.bf16 else 4
    s, b, h = t.seq_length, t.micro_batch_size, model.arch.hidden_size
    per_layer = 34 * s * b * h * act_bytes // 2
    per_layer = per_layer // tp if par.sequence_parallel else per_layer * (10 + 24 / tp) / 34
    micro_batches = t.global_batch_size // (t.micro_batch_size * dp)
    in_flight = min(pp, micro_batches)
    layers = math.ceil(model.arch.num_layers / pp)
    memory = [
        ("weights", shard * weight_bytes),
        ("grads", shard * 4),
        (f"optimizer/{optim_shards}", shard * optim_bytes // optim_shards),
        ("activations", int(per_layer * layers * in_flight * model.ttt_steps)),
        ("logits", ttt_logits_bytes(s * b, math.ceil(model.vocab / tp), model.ttt_steps, act_bytes)),
    ]
    if hasattr(config, "ttt"):  # a distillation config: the drafter's TTT attention
        heads = math.ceil(model.arch.num_attention_heads / tp)
        kv_heads = math.ceil(model.arch.num_query_groups / tp)
        ttt = ttt_attention_bytes(b, heads, s, model.arch.head_dim, model.ttt_steps, act_bytes, kv_heads=kv_heads)
        memory.append(("TTT attention", ttt * layers * in_flight))
    if model.frozen:
        memory.append(("frozen embedding", model.frozen * weight_bytes // tp))
    return memory


def drafter_step_memory(arch: DrafterArch, config, dp: int = 1) -> list[tuple[str, int]]:
    """The plan's per-GPU terms for training drafter `arch` under a distill `config` (no target, no reserve): what
    the device check prints beside the peak it measures."""
    trainable, frozen = arch.num_parameters()
    model = _Trained(arch.body, trainable, frozen, arch.draft_vocab_size, config.drafter.bf16, config.ttt.ttt_steps)
    return _trained_memory(model, config, dp)


def _target_memory(target: ModelArch, parallel, training, bf16: bool) -> list[tuple[str, int]]:
    estimate = estimate_target_memory(
        target,
        **parallel_sizes(parallel),
        micro_batch_size=training.micro_batch_size,
        seq_length=training.seq_length,
        num_captured_layers=4,
        bytes_per_param=2 if bf16 else 4,
        bytes_per_activation=2 if bf16 else 4,
    )
    return [("target weights", estimate.weight_bytes), ("target activations", estimate.activation_bytes)]


def _target_source(recipe: Recipe) -> str:
    """Where the target's shape came from: its config.json, else the preset."""
    path = recipe.path("target")
    return f"{path}/config.json" if hf_config_file(path, "paths.target", missing_ok=True) else f"preset {recipe.target}"


def _target_summary(recipe: Recipe, target: ModelArch, config) -> dict:
    requested = getattr(config, "aux_layer_ids", None)
    if requested is None and recipe.adapt is not None:
        requested = recipe.adapt.aux_layer_ids
    if requested is None:  # a distill config's drafter section (a rollout's drafter is a path: its own taps)
        requested = getattr(getattr(config, "drafter", None), "aux_layer_ids", None)
    return {
        "model_type": target.hf_config.get("model_type"),
        "source": _target_source(recipe),
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_query_groups,
        "vocab_size": target.vocab_size,
        "num_experts": target.num_experts,
        "aux_layer_ids": resolve_aux_layer_ids(requested, target.num_layers),
    }


def make_plan(recipe: Recipe, stage: str, run_dir: str | None = None, cpu: CpuCapability | None = None) -> Plan:
    """Validate `stage`'s layout and size it; raises LayoutError when a parallel size does not divide. `cpu`, this
    machine's capability, is named in a CPU recipe's plan."""
    config = recipe.config(stage, run_dir)
    res = recipe.stage_resources(stage)
    world = res.world_size
    try:
        checks: list[str] = [node_check(recipe, stage)] if recipe.cpus_per_node else []
    except ValueError as err:
        raise LayoutError(str(err)) from None
    memory: list[tuple[str, int]] = []
    target = target_arch(recipe) if stage in TARGET_STAGES or stage == "adapt" else None
    parallel = copy.deepcopy(getattr(config, "parallel", None))
    dp = world
    if parallel is not None and stage in TRAINED_STAGES + TARGET_STAGES:
        if stage == "distill":
            config.target.fold_into(parallel)
        try:
            parallel.validate(world)
            if target is not None:
                target.validate_parallel(
                    parallel.tensor_model_parallel_size,
                    parallel.pipeline_model_parallel_size,
                    parallel.expert_model_parallel_size,
                )
                checks.append(
                    f"target: heads, kv heads, layers{', experts' if target.is_moe else ''} divide the layout"
                )
            if stage in TRAINED_STAGES:
                training = copy.deepcopy(config.training)
                validate_training(training, parallel, world)  # the stage's own check: batch divisibility, lengths
                config.training = training
        except ValueError as err:
            raise LayoutError(f"recipe {recipe.run_name} ({stage}): {err}") from None
        dp = world // parallel.model_parallel_size()
    train_iters = gbs = seq = 0
    budget, schedule = "", None
    if stage in TRAINED_STAGES:
        model = _trained(recipe, stage, config, target)
        checks += _validate_trained(recipe, stage, model, parallel)
        checks.append(f"global batch {config.training.global_batch_size} divisible by micro batch x DP {dp}")
        memory += _trained_memory(model, config, dp)
        t = config.training
        train_iters, gbs, seq = t.num_train_iters(), t.global_batch_size, t.seq_length
        budget, schedule = training_budget(recipe.budget, t, config.optimizer)
    if parallel is not None and stage in TRAINED_STAGES + TARGET_STAGES:
        _refuse_without_te(recipe, stage, config, parallel, target)
    if fp8_check := _fp8_check(recipe, stage, config):
        checks.append(fp8_check)
    if stage in TARGET_STAGES:
        memory += _target_stage_memory(recipe, stage, config, target, parallel)
    if memory:
        memory.append(("runtime reserve", RUNTIME_RESERVE_BYTES))
    return Plan(
        recipe=recipe.run_name,
        stage=stage,
        hardware=recipe.hardware,
        precision=recipe.precision,
        nodes=res.nodes,
        gpus_per_node=res.gpus_per_node,
        world_size=world,
        data_parallel_size=dp,
        checks=tuple(checks),
        memory=tuple(memory),
        gpu_memory_gib=GPU_MEMORY_GIB.get(recipe.hardware),
        train_iters=train_iters,
        global_batch_size=gbs,
        seq_length=seq,
        disk=tuple(_disk(recipe, stage, target, train_iters, gbs, seq)),
        budget=budget,
        target=_target_summary(recipe, target, config) if target is not None else None,
        cpu=cpu.line() if cpu is not None and recipe.hardware == "cpu" else None,
        needs=moe_nodes_needed(recipe, stage, target, parallel, memory, res.gpus_per_node),
        schedule=schedule,
        eval_suites=eval_suite_commands(recipe) or None,
        data_rule=data_rule(recipe),
    )


def _validate_trained(recipe: Recipe, stage: str, model: _Trained, parallel) -> list[str]:
    """The trained model's sizes divide the layout it is built with: the drafter is dense, built at EP 1 inside
    the job's layout (ParallelConfig.dense_layout, as build_drafter_model does). Returns the check lines."""
    built = parallel.dense_layout() if stage == "distill" else parallel
    try:
        model.arch.validate_parallel(
            built.tensor_model_parallel_size, built.pipeline_model_parallel_size, built.expert_model_parallel_size
        )
    except ValueError as err:
        raise LayoutError(f"recipe {recipe.run_name} ({stage}, trained model): {err}") from None
    if built.expert_model_parallel_size == parallel.expert_model_parallel_size:
        return []
    return [
        f"drafter: dense, built at expert parallel size 1 inside the job's EP {parallel.expert_model_parallel_size} "
        f"layout (replicated over the expert-parallel ranks)"
    ]


def _fp8_check(recipe: Recipe, stage: str, config) -> str | None:
    """The check an FP8 model passes on the recipe's GPU (None without FP8 or a known GPU); LayoutError otherwise."""
    fp8 = getattr(config, "model", None)
    if not (getattr(fp8, "fp8_format", None) and recipe.hardware in GPU_CAPABILITY):
        return None
    capability, gpu = GPU_CAPABILITY[recipe.hardware], recipe.hardware.upper()
    refusal = fp8_recipe_refusal(fp8.fp8_recipe, capability, f"its hardware {gpu}")
    if refusal:
        raise LayoutError(f"recipe {recipe.run_name} ({stage}.model.fp8_recipe): {refusal}")
    cuda = FP8_RECIPE_CUDA.get(fp8.fp8_recipe)
    needs = f"; it needs CUDA {cuda[0]}.{cuda[1]}+ in the container, checked at start" if cuda else ""
    return f"FP8 recipe {fp8.fp8_recipe} runs on {gpu} (compute capability {capability[0]}.{capability[1]}){needs}"


def _target_stage_memory(recipe: Recipe, stage: str, config, target: ModelArch, parallel) -> list[tuple[str, int]]:
    """A target stage's terms: the target itself when it runs online, and distillation's LM head rows."""
    if stage == "rollout":  # the target on each replica (the HF backend: all of it per GPU), one sequence at a time
        return _target_memory(target, parallel, _RolloutSequence(recipe, config), config.dtype == "bfloat16")
    memory = []
    bf16 = config.drafter.bf16 if stage == "distill" else recipe.hardware != "cpu"
    if stage == "distill" and config.data.rolls_out_online():
        # Draft-OPD's loop: the HF target whole per rank, at the training batch's shape (its KV cache fits in the
        # same bound), or the Megatron-Core target at the job's layout, recomputing one rollout sequence per verify.
        if config.data.opd_target_backend == "hf":
            whole = dataclasses.replace(parallel, tensor_model_parallel_size=1, expert_model_parallel_size=1)
            memory += _target_memory(target, whole, config.training, bf16)
        else:
            memory += _target_memory(target, parallel, _OnlineRolloutSequence(config), bf16)
    elif stage == "extract" or config.data.mode == "online":
        memory += _target_memory(target, parallel, getattr(config, "training", None) or _ExtractBatch(config), bf16)
    if stage == "distill":
        draft = config.drafter.draft_vocab_size if config.drafter.baseline else None
        memory.append(("target LM head", target_head_bytes(target, parallel.tensor_model_parallel_size, draft)))
    return memory


@dataclasses.dataclass(frozen=True)
class _ExtractBatch:
    """Extraction's prefill batch in the shape the target estimate reads."""

    config: object

    @property
    def micro_batch_size(self) -> int:
        return self.config.micro_batch_size

    @property
    def seq_length(self) -> int:
        return self.config.max_length


@dataclasses.dataclass(frozen=True)
class _RolloutSequence:
    """A rollout's forward in the shape the target estimate reads: one prompt plus its continuation, as long as
    the recipe's server context (what its regeneration allowed), else twice --max-new-tokens."""

    recipe: Recipe
    config: object
    micro_batch_size: int = 1

    @property
    def seq_length(self) -> int:
        return self.recipe.servers.context_length or 2 * self.config.max_new_tokens


@dataclasses.dataclass(frozen=True)
class _OnlineRolloutSequence:
    """The online Draft-OPD rollout's forward on the Megatron-Core target in the shape the target estimate reads:
    one sequence, a prompt as long as --seq-length plus --opd-max-new-tokens (an upper bound)."""

    config: object
    micro_batch_size: int = 1

    @property
    def seq_length(self) -> int:
        return self.config.training.seq_length + self.config.data.opd_max_new_tokens


def _refuse_without_te(recipe: Recipe, stage: str, config, parallel, target: ModelArch | None) -> None:
    """A GPU recipe that asks for the local spec where megatron-core needs Transformer Engine is refused here."""
    impl = getattr(getattr(config, "model", None), "transformer_impl", None) or getattr(
        config, "transformer_impl", None
    )
    if stage == "distill":
        impl = config.drafter.transformer_impl
    try:
        refuse_without_transformer_engine(
            is_moe=bool(target is not None and target.is_moe),
            sequence_parallel=parallel.sequence_parallel,
            transformer_impl="transformer_engine" if impl in (None, "auto") else impl,
            cuda_available=recipe.hardware != "cpu",
        )
    except ValueError as err:
        raise LayoutError(f"recipe {recipe.run_name} ({stage}): {err}") from None


def check_plan(plan: Plan) -> None:
    """Refuse a plan that does not fit the recipe's GPUs, naming every term."""
    if not plan.fits:
        parts = ", ".join(f"{name} {b / GIB:.2f} GiB" for name, b in plan.memory)
        raise LayoutError(
            f"recipe {plan.recipe} ({plan.stage}) needs about {plan.memory_bytes / GIB:.1f} GiB per GPU ({parts}), "
            f"more than the {plan.gpu_memory_gib:g} GiB of a {plan.hardware.upper()}; "
            f"{plan.needs or 'raise the tensor/pipeline/expert parallel sizes or lower the micro batch size'}."
        )


def _disk(recipe: Recipe, stage: str, target: ModelArch | None, iters: int, gbs: int, seq: int):
    disk = []
    if stage in TRAINED_STAGES:
        config = recipe.config(stage)
        model = _trained(recipe, stage, config, target)
        per_param = 14 if model.bf16 else 12  # weights + FP32 master, Adam m and v
        label = f"checkpoint ({model.trainable:,} params x {per_param} bytes, model + optimizer), each"
        disk.append((label, model.trainable * per_param))
    if target is not None and stage in TARGET_STAGES and iters:
        tokens = iters * gbs * seq
        bf16 = tokens * 4 * target.hidden_size * 2
        label = f"hidden states (at most {tokens:,} tokens x 4 x {target.hidden_size}"
        disk.append((f"{label} bf16 values)", bf16))
        disk.append((f"{label} int8, ~{INT8_STORE_RATIO}x)", int(bf16 * INT8_STORE_RATIO)))
    return disk


def plan_json(plan: Plan) -> str:
    return json.dumps(plan.to_json(), indent=2)
