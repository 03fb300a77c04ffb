"""The demo's time budget: a few-second float32 GEMM probe of this machine, the wall time it predicts for each
trained step (Stage 2 pretraining, Stage 4 distillation of Osprey and EAGLE-3) from that step's FLOPs per
iteration, and the step counts that fit the budget.

The model of one trained step is `startup + iterations * flops_per_iteration / (rate * efficiency)`: `rate` is the
probe's float32 GFLOP/s on the demo's thread count, `efficiency` the share of it the step reaches (its attention,
optimizer, norms and Python overhead run below GEMM speed), `startup` its fixed seconds (imports, process groups,
loading, the final save). The steps that do not train (data, prune, adapt, regeneration, extraction, evaluation)
are taken as one figure of measured seconds, scaled by the probe's rate against the rate they were measured at.
`resize` is a pure function of (rate, budget): it shortens Stage 2 first, down to STAGE2_FLOOR of its iterations,
then the distillation epochs, down to DISTILL_FLOOR, so that the predicted total fits.
"""

from __future__ import annotations

import dataclasses
import math
import time

BUDGET_SECONDS = 30 * 60  # `make demo`'s promise

# The probe: one GEMM of the shape of the demo's MLP (tokens x hidden x FFN of SmolLM2: 1024 x 576 x 1536).
PROBE_SHAPE = (1024, 576, 1536)


def gemm_rate(threads: int, seconds: float = 2.0) -> float:
    """float32 GFLOP/s of PROBE_SHAPE matmuls on `threads` threads for about `seconds` (after one warm-up)."""
    import torch

    m, k, n = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=generator), torch.randn(k, n, generator=generator)
    out = torch.empty(m, n)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.mm(a, b, out=out)
        count, start = 0, time.perf_counter()
        while True:
            torch.mm(a, b, out=out)
            count += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
    finally:
        torch.set_num_threads(previous)
    return 2.0 * m * k * n * count / elapsed / 1e9


@dataclasses.dataclass(frozen=True)
class StageCost:
    """One trained step's measured constants (see the module docstring)."""

    # The step's counted FLOP/s (training/flops.py's count over its iteration time) over the probe's rate. Not a
    # hardware efficiency: the count assumes every sequence fills --seq-length, so a step whose batches are shorter
    # (distillation of regenerated conversations) reads above 1.
    efficiency: float
    startup: float  # seconds besides its iterations (start-up, loading, the final save)


# Measured with benchmarks/demo_budget_calibration.py (6 iterations of each trained step at the quick demo's shapes:
# seq 256, Stage 2 global batch 8, distillation 4 with 5 TTT steps) on this project's 2-core machine with the AVX2
# path forced (MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
# OSPREY_CPU_CAPABILITY=avx2), OMP_NUM_THREADS=2, float32, while other engineers' jobs shared the 2 cores:
#   run 1 (load average 9 rising to 23): probe 56.8 GFLOP/s before, 11.7 after; Stage 2 9.86 s per iteration
#     (44.5 counted GFLOP/s: 0.78 of the first probe), start-up 22.5 s; its distillation data were short (16-token
#     replies), so its distillation figures are not used;
#   run 2 (load average 33-39, replies of the demo's 96 tokens): probes 11.2, 6.8, 5.7, 10.1 GFLOP/s; Stage 2 28.9 s
#     per iteration (15.2 counted GFLOP/s), Osprey's distillation 21.2 s (51.6 counted GFLOP/s: 3.4x Stage 2's),
#     EAGLE-3's 5.57 s (59.4: 3.9x), start-ups 68, 135 and 58 s.
# Stage 2's ratio is run 1's against its least contended probe (0.78; the 17 min for 120 iterations on this
# path is 0.91); the distillations' are Stage 2's times their run-2 multiples, rounded to 2.4 and 3.6 (the native-bf16
# demo's per-iteration times give 2.75x and 5.4x); the start-ups are run 1's, rounded up.
STAGE_COSTS = {
    "pretrain": StageCost(efficiency=0.8, startup=25.0),
    "distill_osprey": StageCost(efficiency=2.4, startup=75.0),
    "distill_eagle3": StageCost(efficiency=3.6, startup=50.0),
}
# The untrained steps of `make demo`, in seconds at OTHER_STEPS_RATE GFLOP/s (run 1's first probe): fixed ones (the
# target asset, osprey data 4 s, preprocessing 1, prune 15, adapt 30, extraction's start-up 10, the evaluation 120:
# not measured on this path, the last make demo's 69 s rounded up), per training conversation the regeneration
# in-process (run 2: 45 s each at a probe of 6.3 GFLOP/s, 5.0 s at OTHER_STEPS_RATE; the native demo's 5.4) and the
# extraction; with the vLLM engine installed, regeneration and evaluation in vLLM (the last make demo's 69 + 670 s,
# measured on the native-bf16 path under contention) instead of the in-process regeneration.
OTHER_FIXED_SECONDS = 190.0
REGENERATE_SECONDS_PER_CONVERSATION = 5.0
EXTRACT_SECONDS_PER_CONVERSATION = 0.5
VLLM_SECONDS = 740.0
OTHER_STEPS_RATE = 56.8
STAGE2_FLOOR = 0.25  # Stage 2 keeps at least this share of its iterations before distillation is shortened
DISTILL_FLOOR = 0.25  # and distillation this share of its epochs (below it the comparison says little): a machine
# too slow for both floors runs them, over the budget, and the line says why


@dataclasses.dataclass(frozen=True)
class TrainedStep:
    """A trained step of the demo: its name (a STAGE_COSTS key), iterations and FLOPs per iteration."""

    name: str
    iterations: int
    flops_per_iteration: float

    def seconds(self, rate_gflops: float, iterations: int | None = None) -> float:
        cost = STAGE_COSTS[self.name]
        n = self.iterations if iterations is None else iterations
        return cost.startup + n * self.flops_per_iteration / (rate_gflops * 1e9 * cost.efficiency)


@dataclasses.dataclass(frozen=True)
class Resize:
    """What `resize` decided: the prediction before and after, and the scale of each trained step's iterations."""

    rate_gflops: float
    budget: float
    predicted: float  # seconds at the configured sizes
    predicted_after: float  # seconds at the sizes chosen
    other: float = 0.0  # of them, the untrained steps' seconds (not resized)
    stage2_scale: float = 1.0
    distill_scale: float = 1.0

    @property
    def resized(self) -> bool:
        return self.stage2_scale < 1.0 or self.distill_scale < 1.0


def other_reference_seconds(conversations: int, vllm: bool) -> float:
    """The untrained steps' seconds at OTHER_STEPS_RATE for `conversations` regenerated training conversations."""
    regenerate = VLLM_SECONDS if vllm else conversations * REGENERATE_SECONDS_PER_CONVERSATION
    return OTHER_FIXED_SECONDS + regenerate + conversations * EXTRACT_SECONDS_PER_CONVERSATION


def resize(rate_gflops: float, budget: float, steps: list[TrainedStep], other_reference: float = 0.0) -> Resize:
    """The largest scales (Stage 2 first, down to STAGE2_FLOOR, then distillation, down to DISTILL_FLOOR) whose
    predicted total fits
    `budget` seconds at `rate_gflops`, the untrained steps taking `other_reference` seconds at OTHER_STEPS_RATE;
    scales are 1 where it already fits. Pure: no clock, no model."""
    if not rate_gflops > 0:
        raise ValueError(f"the measured GEMM rate must be positive, got {rate_gflops}.")
    other = other_reference * OTHER_STEPS_RATE / rate_gflops
    stage2 = [s for s in steps if s.name == "pretrain"]
    distill = [s for s in steps if s.name != "pretrain"]

    def total(s2: float, d: float) -> float:
        return (
            other
            + sum(s.seconds(rate_gflops, scaled(s.iterations, s2)) for s in stage2)
            + sum(s.seconds(rate_gflops, scaled(s.iterations, d)) for s in distill)
        )

    predicted = total(1.0, 1.0)
    if predicted <= budget:
        return Resize(rate_gflops, budget, predicted, predicted, other)
    s2 = _largest_scale(lambda x: total(x, 1.0), budget, STAGE2_FLOOR)
    d = 1.0
    if total(s2, 1.0) > budget:
        s2 = STAGE2_FLOOR
        d = _largest_scale(lambda x: total(STAGE2_FLOOR, x), budget, DISTILL_FLOOR)
    return Resize(rate_gflops, budget, predicted, total(s2, d), other, s2, d)


def scaled(iterations: int, scale: float) -> int:
    """`iterations` times `scale`, rounded down, at least 1."""
    return max(1, math.floor(iterations * scale + 1e-9))


def _largest_scale(total, budget: float, floor: float) -> float:
    """The largest scale in [floor, 1] (to 1e-3) with total(scale) <= budget; floor when none fits."""
    low, high = floor, 1.0
    if total(low) > budget:
        return floor
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if total(middle) <= budget else (low, middle)
    return math.floor(low * 1000) / 1000


# The global batch of the demo's Stage 2 (demo/commands.pretrain_argv).
PRETRAIN_GLOBAL_BATCH = 8


def demo_trained_steps(cfg, target, samples: int) -> list[TrainedStep]:
    """The trained steps of a demo of size `cfg` on `target` (an HF directory) with `samples` training
    conversations per domain, their FLOPs per iteration counted as the stages count them (training/flops.py)."""
    from megatron_osprey.base.arch import ModelArch
    from megatron_osprey.losses.config import TTTLossConfig
    from megatron_osprey.models.drafter.arch import eagle3_body
    from megatron_osprey.training.flops import training_flops_per_sequence

    arch = ModelArch.from_hf_config(target)
    pruned, seq = arch.with_num_layers(2), cfg.seq_length
    ttt = cfg.ttt_steps or TTTLossConfig().ttt_steps
    vocab = arch.padded_vocab_size(1)
    draft_vocab = cfg.draft_vocab_size(arch.vocab_size)
    pretrain = PRETRAIN_GLOBAL_BATCH * training_flops_per_sequence(pruned, seq, vocab)
    osprey = cfg.distill_batch * ttt * training_flops_per_sequence(pruned, seq, vocab)
    eagle3 = cfg.distill_batch * ttt * training_flops_per_sequence(eagle3_body(arch, 1), seq, draft_vocab)
    distill_iters = distill_iterations(cfg, samples)
    per_domain = len(cfg.train_domains) * len(cfg.seeds)
    return [
        TrainedStep("pretrain", cfg.backbone_iters, pretrain),
        *[TrainedStep("distill_osprey", distill_iters, osprey)] * per_domain,
        *[TrainedStep("distill_eagle3", distill_iters, eagle3)] * per_domain,
    ]


def distill_iterations(cfg, samples: int) -> int:
    """Stage 4's iterations at `samples` conversations (demo/commands.distill_argv's count)."""
    return max(1, math.ceil(cfg.distill_epochs * samples / cfg.distill_batch))


BUDGET_FILE = "budget.json"  # in the demo's output: a resumed run keeps the sizes its first run chose


def fit_to_budget(cfg, target, output, budget: float, threads: int, vllm: bool, say=print):
    """`cfg` resized (Resize) so that its predicted wall time on this machine fits `budget` seconds, with
    `cfg.resized` saying so; one line says the measured rate, the prediction and what changed. A resumed run
    (OUTPUT/budget.json) keeps the sizes its first run chose, so its steps' commands stay the same."""
    import json
    from pathlib import Path

    from megatron_osprey.base.atomic_io import write_json_atomic

    record = Path(output) / BUDGET_FILE
    if record.is_file():
        kept = json.loads(record.read_text())
        say(f"budget: resuming with the sizes the first run chose: {kept['line']}")
        return dataclasses.replace(
            cfg, backbone_iters=kept["backbone_iters"], distill_epochs=kept["distill_epochs"], resized=kept["resized"]
        )
    began = time.perf_counter()
    rate = gemm_rate(threads)
    probe = time.perf_counter() - began
    steps = demo_trained_steps(cfg, target, cfg.n_train)
    decision = resize(rate, budget, steps, other_reference_seconds(cfg.n_train, vllm))
    fitted = apply(cfg, decision)
    line = describe(decision, cfg, fitted, threads, probe)
    say(line)
    fitted = dataclasses.replace(fitted, resized=line if decision.resized else None)
    write_json_atomic(
        record,
        {
            "rate_gflops": rate,
            "threads": threads,
            "line": line,
            "resized": fitted.resized,
            "backbone_iters": fitted.backbone_iters,
            "distill_epochs": fitted.distill_epochs,
        },
    )
    return fitted


def apply(cfg, decision: Resize):
    """`cfg` with Stage 2's iterations and the distillation epochs scaled as `decision` says."""
    return dataclasses.replace(
        cfg,
        backbone_iters=scaled(cfg.backbone_iters, decision.stage2_scale),
        distill_epochs=round(cfg.distill_epochs * decision.distill_scale, 3),
    )


def describe(decision: Resize, before, after, threads: int, probe_seconds: float) -> str:
    """The one line: the measured rate, the prediction, and what the resize changed (or that nothing did)."""
    head = (
        f"budget: float32 GEMM {decision.rate_gflops:.1f} GFLOP/s on {threads} thread(s) ({probe_seconds:.1f} s "
        f"probe); predicted {decision.predicted / 60:.1f} min for a {decision.budget / 60:.0f}-min budget"
    )
    if not decision.resized:
        return head + ": sizes unchanged"
    changes = []
    if after.backbone_iters != before.backbone_iters:
        changes.append(f"Stage 2 {before.backbone_iters} -> {after.backbone_iters} iterations")
    if after.distill_epochs != before.distill_epochs:
        updates = (distill_iterations(before, before.n_train), distill_iterations(after, after.n_train))
        changes.append(
            f"distillation {before.distill_epochs:g} -> {after.distill_epochs:g} epochs ({updates[0]} -> "
            f"{updates[1]} updates)"
        )
    over = ""
    if decision.predicted_after > decision.budget:  # the smallest sizes do not fit: say what does not shrink
        over = (
            f", still over the budget: the untrained steps (regeneration, extraction, evaluation...) alone take "
            f"{decision.other / 60:.1f} min here"
        )
    return (
        f"{head}: RESIZED {', '.join(changes)}; predicted {decision.predicted_after / 60:.1f} min{over} "
        f"(--no-resize keeps the sizes)"
    )
