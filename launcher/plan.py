"""`osprey plan`: check a recipe's layout and size it (world, memory per GPU, tokens, disk) without a cluster.

Memory model (estimates, meant to catch layouts that cannot fit, not to replace a profiler):
- trained model, per GPU, with P/(TP*PP) parameters: BF16 weights (2 bytes), FP32 main grads (4) and
  Adam states with FP32 master weights (12), the last divided by DP under the distributed optimizer
  (Megatron's 6 + 12/DP bytes per parameter); float32 runs: 4 + 4 + 8.
- activations: 34 * s * b * h bytes per layer and micro-batch (Korthikanti et al. 2022, flash
  attention, no recomputation), divided by TP under sequence parallelism, times the TTT steps for
  distillation, plus the LM-head logits (BF16 logits and an FP32 softmax: 6 bytes per entry) of every
  TTT step; under pipeline parallelism the first stage holds PP micro-batches of its layers.
- TTT attention (distillation): the 34*s*b*h term covers one causal flash attention per step; the
  drafter's TTT attention also keeps, per layer, the diagonal keys of earlier steps and its padded
  fused-kernel inputs: megatron_osprey.base.memory.ttt_attention_bytes, linear in s (measured
  by benchmarks/ttt_attention_memory.py). The exact masked attention it replaced kept K*s^2 scores.
- frozen target: megatron_osprey.base.memory (weights / (TP*PP*EP) and prefill activations,
  with a 3 GiB runtime reserve), in BF16: the frozen target is built in BF16 (or FP32), never FP8, so a
  recipe that asks for a target FP8 forward (drafter.target_fp8_format) is refused rather than planned
  with 1-byte weights it would not get.
"""

from __future__ import annotations

import dataclasses
import math

from launcher.commands import ENTRY_POINTS
from megatron_osprey.base.memory import GIB, RUNTIME_RESERVE_BYTES, estimate_target_memory, ttt_attention_bytes
from megatron_osprey.config.recipes.recipe import GPU_MEMORY_GIB, Recipe, shared_tensor_parallel
from megatron_osprey.config.recipes.shapes import ModelShape

TRAINED_STAGES = ("pretrain", "distill")
TARGET_STAGES = ("distill", "extract")
# Offline hidden-state stores in int8 take about this share of bf16 (values plus per-row scales).
INT8_STORE_RATIO = 0.45


class LayoutError(ValueError):
    """The recipe's layout cannot run: a parallel size does not divide what it splits."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """The numbers `osprey plan` prints."""

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
    iterations: int
    tokens: int
    disk: tuple[tuple[str, int], ...]
    budget: str = ""  # how the recipe's step count arises (epochs x examples / global batch, or fixed)

    @property
    def memory_bytes(self) -> int:
        return sum(b for _, b in self.memory)

    def lines(self) -> list[str]:
        """Human-readable report, one fact per line."""
        out = [
            f"recipe   {self.recipe} (stage {self.stage}, {self.hardware}, {self.precision})",
            f"world    {self.nodes} node(s) x {self.gpus_per_node} GPU(s) per node = {self.world_size} ranks; "
            f"data parallel {self.data_parallel_size}",
        ]
        out += [f"check    {c}" for c in self.checks]
        if self.memory:
            parts = " + ".join(f"{name} {b / GIB:.2f}" for name, b in self.memory)
            budget = f" of {self.gpu_memory_gib:g} GiB ({self.hardware.upper()})" if self.gpu_memory_gib else ""
            out.append(f"memory   per GPU (GiB): {parts} = {self.memory_bytes / GIB:.2f} GiB{budget}")
        if self.iterations:
            out.append(f"steps    {self.iterations:,} iterations; {self.tokens:,} tokens ({self.tokens / 1e9:.2f}B)")
            if self.budget:
                out.append(f"budget   {self.budget}")
        out += [f"disk     {name}: {_size(b)}" for name, b in self.disk]
        return out


def _size(num_bytes: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", GIB), ("MiB", 1 << 20)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def osprey_drafter_parameters(backbone: ModelShape, target: ModelShape, draft_vocab: int | None) -> int:
    """Trainable parameters of the adapted Osprey drafter (2H-wide QKV input, fusion_fc, target vocab)."""
    h, d = backbone.hidden_size, backbone.head_dim
    q, kv = backbone.num_attention_heads * d, backbone.num_key_value_heads * d
    layer = 2 * h * (q + 2 * kv) + q * h + 2 * d + 3 * h * backbone.ffn_hidden_size + 3 * h
    embed = target.vocab_size * h
    head = draft_vocab * h if draft_vocab else (0 if backbone.tie_word_embeddings else embed)
    return backbone.num_layers * layer + embed + head + 3 * target.hidden_size * h + h


def eagle3_parameters(drafter: ModelShape, target: ModelShape, draft_vocab: int | None) -> tuple[int, int]:
    """(trainable, frozen) parameters of the EAGLE-3 baseline; the frozen part is the target's embedding."""
    h, d = drafter.hidden_size, drafter.head_dim
    q, kv = drafter.num_attention_heads * d, drafter.num_key_value_heads * d
    layer = 2 * h * (q + 2 * kv) + q * h + 3 * h * drafter.ffn_hidden_size + 3 * h
    head = (draft_vocab or target.vocab_size) * h
    trainable = drafter.num_layers * layer + 3 * target.hidden_size * h + head + h
    return trainable, target.vocab_size * target.hidden_size


def trained_parameters(recipe: Recipe, stage: str) -> tuple[int, int, int]:
    """(trainable, frozen, output vocabulary) of the model `stage` trains."""
    if stage == "pretrain":
        return recipe.model.num_parameters(), 0, recipe.model.vocab_size
    dr = recipe.drafter
    vocab = dr.draft_vocab_size or recipe.target.vocab_size
    if dr.method == "eagle3":
        trainable, frozen = eagle3_parameters(recipe.model, recipe.target, dr.draft_vocab_size)
        return trainable, frozen, vocab
    return osprey_drafter_parameters(recipe.model, recipe.target, dr.draft_vocab_size), 0, vocab


def _check_divides(checks: list[str], what: str, value: int, size: int, flag: str, key: str) -> None:
    if value % size:
        raise LayoutError(
            f"{flag} {size} (recipe key {key}) does not divide the {what} ({value}); "
            f"choose a size that divides {value}."
        )
    checks.append(f"{what} {value} divisible by {flag} {size}")


def _check_model(recipe: Recipe, stage: str, checks: list[str]) -> int:
    """Validate the trained model's TP/PP/CP/EP; returns its data-parallel size."""
    lay, t = recipe.layout, recipe.training
    for key in ("micro_batch_size", "global_batch_size", "seq_length"):
        if getattr(t, key) < 1:  # a size of 0 would only surface as a ZeroDivisionError below
            raise LayoutError(
                f"recipe {recipe.run_name}: training.{key} must be >= 1, got {getattr(t, key)} "
                f"(--set training.{key}=N)."
            )
    tp, pp, cp, ep = (
        lay.tensor_model_parallel_size,
        lay.pipeline_model_parallel_size,
        lay.context_parallel_size,
        lay.expert_model_parallel_size,
    )
    try:
        recipe.model.arch().validate_parallel(tp, pp, ep)
    except ValueError as err:
        raise LayoutError(f"recipe {recipe.run_name} ({stage}, {recipe.model.name}): {err}") from None
    m = recipe.model
    checks.append(
        f"{m.name}: heads {m.num_attention_heads}, kv heads {m.num_key_value_heads}, "
        f"ffn {m.ffn_hidden_size} divisible by TP {tp}; layers {m.num_layers} by PP {pp}"
    )
    model_parallel = tp * pp * cp
    _check_divides(
        checks,
        f"world size ({lay.nodes} x {lay.gpus_per_node})",
        lay.world_size,
        model_parallel,
        "TP x PP x CP =",
        "layout",
    )
    dp = lay.world_size // model_parallel
    if cp > 1:
        raise LayoutError(
            f"recipe {recipe.run_name} ({stage}): --context-parallel-size {cp} (layout.context_parallel_size) "
            f"is not supported: batches are not split per context-parallel rank; use 1."
        )
    _check_divides(
        checks,
        "global batch size",
        t.global_batch_size,
        t.micro_batch_size * dp,
        f"--micro-batch-size {t.micro_batch_size} x data parallel {dp} =",
        "training.global_batch_size",
    )
    return dp


def _check_target(recipe: Recipe, stage: str, checks: list[str]) -> int:
    """Validate the frozen target's TP/PP/EP; returns its data-parallel size."""
    lay = recipe.layout
    tp, pp, ep = (
        lay.target_tensor_model_parallel_size,
        lay.target_pipeline_model_parallel_size,
        lay.target_expert_model_parallel_size,
    )
    etp = lay.target_expert_tensor_parallel_size or tp
    prefix = "--target-" if stage == "distill" else "--"
    try:
        recipe.target.arch().validate_parallel(tp, pp, ep)
    except ValueError as err:
        message = str(err).replace("--", prefix) if prefix != "--" else str(err)
        raise LayoutError(
            f"recipe {recipe.run_name} ({stage}, target {recipe.target.name}): {message} (recipe keys layout.target_*)"
        ) from None
    t = recipe.target
    checks.append(
        f"target {t.name}: heads {t.num_attention_heads}, kv heads {t.num_key_value_heads} divisible by "
        f"{prefix}tensor-model-parallel-size {tp}; layers {t.num_layers} by PP {pp}"
        + (f"; experts {t.num_experts} by EP {ep}" if t.num_experts else "")
    )
    _check_divides(
        checks,
        f"world size ({lay.nodes} x {lay.gpus_per_node})",
        lay.world_size,
        tp * pp,
        f"{prefix}tensor-model-parallel-size x pipeline =",
        "layout.target_tensor_model_parallel_size",
    )
    if t.num_experts:
        _check_divides(
            checks,
            "ranks per pipeline stage",
            lay.world_size // pp,
            ep * etp,
            f"{prefix}expert-model-parallel-size x expert-tensor-parallel =",
            "layout.target_expert_model_parallel_size",
        )
    elif ep > 1:
        raise LayoutError(
            f"{prefix}expert-model-parallel-size {ep} needs a mixture-of-experts target; {t.name} is dense, use 1."
        )
    return lay.world_size // (tp * pp)


def _trained_memory(recipe: Recipe, stage: str, dp: int) -> list[tuple[str, int]]:
    lay, t = recipe.layout, recipe.training
    tp, pp = lay.tensor_model_parallel_size, lay.pipeline_model_parallel_size
    trainable, frozen, vocab = trained_parameters(recipe, stage)
    shard = math.ceil(trainable / (tp * pp))
    weight_bytes, optim_bytes = (2, 12) if t.bf16 else (4, 8)
    optim_shards = dp if t.use_distributed_optimizer else 1
    act_bytes = 2 if t.bf16 else 4
    m = recipe.model
    s, b, h = t.seq_length // lay.context_parallel_size, t.micro_batch_size, m.hidden_size
    per_layer = 34 * s * b * h * act_bytes // 2
    per_layer = per_layer // tp if lay.sequence_parallel else per_layer * (10 + 24 / tp) / 34
    steps = recipe.drafter.ttt_steps if stage == "distill" else 1
    micro_batches = t.global_batch_size // (t.micro_batch_size * dp)
    in_flight = min(pp, micro_batches)
    activations = int(per_layer * math.ceil(m.num_layers / pp) * in_flight * steps)
    logits = s * b * math.ceil(vocab / tp) * 6 * steps
    memory = [
        ("weights", shard * weight_bytes),
        ("grads", shard * 4),
        (f"optimizer/{optim_shards}", shard * optim_bytes // optim_shards),
        ("activations", activations),
        ("logits", logits),
    ]
    if stage == "distill":
        heads = math.ceil(m.num_attention_heads / tp)
        ttt = ttt_attention_bytes(b, heads, s, m.head_dim, steps, act_bytes)
        memory.append(("TTT attention", ttt * math.ceil(m.num_layers / pp) * in_flight))
    if frozen:
        memory.append(("frozen embedding", frozen * weight_bytes // tp))
    return memory


def _refuse_target_fp8(recipe: Recipe, stage: str) -> None:
    """The distill and extract entry points build the target in BF16: no flag carries a target FP8 format."""
    fmt = recipe.drafter.target_fp8_format
    if fmt:
        raise LayoutError(
            f"recipe {recipe.run_name} ({stage}) asks for an FP8 target forward (drafter.target_fp8_format={fmt}), "
            f"which is not implemented: the frozen target is built in BF16 and would need about twice the "
            f"planned weight memory. Use the matching _bf16 recipe or --set drafter.target_fp8_format=null."
        )


def _target_memory(recipe: Recipe) -> list[tuple[str, int]]:
    lay, t = recipe.layout, recipe.training
    estimate = estimate_target_memory(
        recipe.target.arch(),
        tensor_parallel=lay.target_tensor_model_parallel_size,
        pipeline_parallel=lay.target_pipeline_model_parallel_size,
        expert_parallel=lay.target_expert_model_parallel_size,
        expert_tensor_parallel=lay.target_expert_tensor_parallel_size,
        micro_batch_size=t.micro_batch_size,
        seq_length=t.seq_length,
        num_captured_layers=4,
        bytes_per_param=2 if t.bf16 else 4,
        bytes_per_activation=2 if t.bf16 else 4,
    )
    return [("target weights", estimate.weight_bytes), ("target activations", estimate.activation_bytes)]


def _target_head_bytes(recipe: Recipe) -> int:
    """Distillation's TargetHead, in both modes: float32 rows of the LM head per TP rank, plus the draft rows."""
    tp, target = recipe.layout.tensor_model_parallel_size, recipe.target
    rows = math.ceil(target.vocab_size / tp)
    draft = recipe.drafter.draft_vocab_size
    if draft and draft != target.vocab_size:
        rows += math.ceil(draft / tp)
    return rows * target.hidden_size * 4


def make_plan(recipe: Recipe, stage: str | None = None) -> Plan:
    """Validate the layout for `stage` (default: the recipe's) and size it; raises LayoutError when invalid."""
    stage = stage or recipe.stage
    if stage not in ENTRY_POINTS:
        raise ValueError(f"--stage {stage!r} is not one of {', '.join(ENTRY_POINTS)}.")
    if stage == "distill" and recipe.target is not None:
        # What the distill config runs: drafter and target on one TP group (Recipe.config()).
        size, sequence_parallel = shared_tensor_parallel(recipe)
        recipe = dataclasses.replace(
            recipe,
            layout=dataclasses.replace(
                recipe.layout, tensor_model_parallel_size=size, sequence_parallel=sequence_parallel
            ),
        )
    lay, t = recipe.layout, recipe.training
    checks: list[str] = []
    memory: list[tuple[str, int]] = []
    dp = lay.world_size
    online = stage == "extract" or (stage == "distill" and recipe.drafter.mode == "online")
    target_checks: list[str] = []
    if stage in TARGET_STAGES:
        if recipe.target is None:
            raise ValueError(f"recipe {recipe.name} has no target shape; `{stage}` needs one.")
        _refuse_target_fp8(recipe, stage)
        # The target first: in distillation its TP size is also the drafter's.
        target_dp = _check_target(recipe, stage, target_checks)
        if stage == "extract":
            dp = target_dp
    if stage in TRAINED_STAGES:
        if recipe.model is None:
            raise ValueError(f"recipe {recipe.name} has no model shape; `{stage}` trains one.")
        dp = _check_model(recipe, stage, checks)
        memory += _trained_memory(recipe, stage, dp)
    checks += target_checks
    if stage in TARGET_STAGES:
        if online:
            memory += _target_memory(recipe)
        if stage == "distill":
            memory.append(("target LM head", _target_head_bytes(recipe)))
    if memory:
        memory.append(("runtime reserve", RUNTIME_RESERVE_BYTES))
    budget_gib = GPU_MEMORY_GIB.get(recipe.hardware)
    plan_memory = sum(b for _, b in memory)
    if budget_gib and plan_memory > budget_gib * GIB:
        parts = ", ".join(f"{name} {b / GIB:.2f} GiB" for name, b in memory)
        raise LayoutError(
            f"recipe {recipe.run_name} ({stage}) needs about {plan_memory / GIB:.1f} GiB per GPU ({parts}), more than "
            f"the {budget_gib:g} GiB of a {recipe.hardware.upper()}; raise the tensor/pipeline/expert parallel sizes "
            f"or lower training.micro_batch_size."
        )
    iterations = t.iterations() if stage in TRAINED_STAGES else 0
    tokens = iterations * t.global_batch_size * t.seq_length
    budget = ""
    if iterations:
        per_rank = t.global_batch_size // max(dp, 1)
        source = (
            f"{t.train_iters:,} iterations fixed"
            if t.train_iters is not None
            else f"{t.epochs:g} epochs x {t.num_examples:,} examples / global batch {t.global_batch_size}"
        )
        budget = (
            f"{source}; global batch {t.global_batch_size} ({per_rank} per data-parallel rank) x seq "
            f"{t.seq_length:,} = {t.global_batch_size * t.seq_length:,} tokens per step at most; lr {t.lr:g}, "
            f"warmup {t.warmup_iters():,} iterations, clip {t.clip_grad:g}"
        )
    return Plan(
        recipe=recipe.run_name,
        stage=stage,
        hardware=recipe.hardware,
        precision=recipe.precision,
        nodes=lay.nodes,
        gpus_per_node=lay.gpus_per_node,
        world_size=lay.world_size,
        data_parallel_size=dp,
        checks=tuple(checks),
        memory=tuple(memory),
        gpu_memory_gib=budget_gib,
        iterations=iterations,
        tokens=tokens,
        disk=tuple(_disk(recipe, stage)),
        budget=budget,
    )


def _disk(recipe: Recipe, stage: str) -> list[tuple[str, int]]:
    disk = []
    if stage in TRAINED_STAGES:
        trainable, _, _ = trained_parameters(recipe, stage)
        per_param = 14 if recipe.training.bf16 else 12  # weights + FP32 master, Adam m and v
        disk.append(
            (f"checkpoint ({trainable:,} params x {per_param} bytes, model + optimizer), each", trainable * per_param)
        )
    if recipe.target is not None and stage in ("distill", "extract"):
        tokens = recipe.training.num_examples * recipe.training.seq_length
        bf16 = tokens * 4 * recipe.target.hidden_size * 2
        label = (
            f"hidden states ({recipe.training.num_examples:,} examples x {recipe.training.seq_length:,} tokens "
            f"at most x 4 x {recipe.target.hidden_size}"
        )
        disk.append((f"{label} bf16 values)", bf16))
        disk.append((f"{label} int8, ~{INT8_STORE_RATIO}x)", int(bf16 * INT8_STORE_RATIO)))
    return disk
