"""The demo's time budget: a few-second float32 GEMM probe of this machine, the wall time it predicts for every
step of `make demo`, and the sizes that fit the budget.

The model of one trained step (Stage 2 pretraining, Stage 4 distillation of Osprey and EAGLE-3) is `startup +
iterations * flops_per_iteration / (rate * efficiency)`: `rate` is the probe's float32 GFLOP/s on the demo's thread
count, `efficiency` the share of it the step reaches (its attention, optimizer, norms and Python overhead run below
GEMM speed), `startup` its fixed seconds (imports, process groups, loading, the final save). The steps that do not
train (data, prune, adapt, regeneration, extraction, the reference evaluation) are measured seconds, and the
evaluation in vLLM (`eval_vllm`: the target alone and each drafter served, every eval prompt at each concurrency
level) is servers x (start-up + decode steps of its sweep); all of them are scaled by the probe's rate against the
rate they were measured at (CALIBRATION_RATE).

`resize` is a pure function of (rate, budget): it fits the prediction to FIT_SHARE of the budget by dropping the vLLM
sweep's higher concurrency levels first (down to the lowest alone), then shortening Stage 2, down to STAGE2_FLOOR of
its iterations, then the distillation epochs, down to DISTILL_FLOOR. That order keeps the trained steps, whose
drafters the demo compares, whole the longest: the higher concurrency levels only add tokens/s rows on a 2-core CPU,
while vLLM's acceptance length, its lossless check and its comparison with the reference engine are all taken at the
lowest level, on every prompt the reference engine ran. The regeneration is never shortened: fewer or shorter
conversations would change the data both arms learn from, not just their schedule.
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


# Fitted to one whole `make demo` (commit 61d672d, from an empty demo_out, the vLLM engine installed) on this
# project's 2-core machine with the AVX2 path forced (MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2
# ONEDNN_MAX_CPU_ISA=AVX2 OSPREY_CPU_CAPABILITY=avx2), float32, nothing else running: the probe measured
# CALIBRATION_RATE GFLOP/s on 2 threads and the demo took 2,063 s: Stage 2 533, regeneration in vLLM 114, extraction
# 35, Osprey's distillation 289, EAGLE-3's 110, the reference evaluation 132, the evaluation in vLLM 779, the rest
# (target asset, data, preprocessing, prune, adapt, the probe, the report) 71. The model at that rate gives each of
# these back to 1% (tests/unit/test_demo_budget.py checks it).
CALIBRATION_RATE = 177.6
# The trained steps keep the start-ups of the first calibration runs (benchmarks/demo_budget_calibration.py, 6
# iterations a step under contention: 22.5 s measured for Stage 2, rounded up) and take their efficiencies from the
# run above: Stage 2 (533 - 25) / 120 = 4.23 s per 438.5 GFLOP iteration, 103.6 counted GFLOP/s, 0.58 of the probe;
# Osprey's distillation (289 - 75) / 48 = 4.46 s per 1,096.3 GFLOP, 1.38; EAGLE-3's (110 - 50) / 48 = 1.25 s per
# 330.7 GFLOP, 1.49. The contended calibration runs had read 0.78 for Stage 2 against a probe of 56.8 GFLOP/s (and
# 3.4x / 3.9x of it for the distillations): under contention the probe falls further than the steps do, so there
# this model predicts the trained steps up to about 1.35x too long, and shortens the run more than it needs to.
STAGE_COSTS = {
    "pretrain": StageCost(efficiency=0.58, startup=25.0),
    "distill_osprey": StageCost(efficiency=1.38, startup=75.0),
    "distill_eagle3": StageCost(efficiency=1.49, startup=50.0),
}
# The untrained steps, in seconds at CALIBRATION_RATE. Fixed: the rest above (71 s) and the reference evaluation
# (132 s: it is not resized). Extraction: its start-up (10 s, as first estimated) and (35 - 10) / 96 s per training
# conversation. Regeneration in vLLM: a server's start-up and (114 - 50) / 96 s per conversation; in-process (no vLLM
# engine) 45 s per conversation at a probe of 6.3 GFLOP/s (the contended calibration run 2), 1.6 at this rate.
OTHER_FIXED_SECONDS = 71.0
EVAL_SECONDS = 132.0
EXTRACT_STARTUP = 10.0
EXTRACT_SECONDS_PER_CONVERSATION = 0.26
REGENERATE_SECONDS_PER_CONVERSATION = 1.6
VLLM_REGENERATE_SECONDS_PER_CONVERSATION = 0.67
# vLLM: a server's start-up, eager on CPU, about 50 s (docs/vllm.md); the evaluation in vLLM is then 3 servers (the
# target alone, Osprey, EAGLE-3) x (50 s + 5 splits x the decode steps of its sweep x VLLM_DECODE_STEP_SECONDS). A
# sweep level at concurrency c decodes ceil(prompts / c) waves of `tokens` steps, a step of n requests in flight costing
# 1 + BATCH_STEP_COST x (n - 1) steps of one: 0.22 from the per-concurrency tokens/s of the last native-bf16 make
# demo's vLLM table (docs/demo-and-results.md; summed over its three servers, concurrency 4 took 0.425 and 16 with 8
# prompts 0.310 of concurrency 1's seconds per token; the model gives 0.415 and 0.318). The quick demo's sweep (8
# prompts, 32 tokens, concurrency 1 4 16) is 256 + 106.2 + 81.3 = 443.5 decode steps a split, 6,652.8 over 3 servers
# x 5 splits, so a step is (779 - 3 x 50) / 6,652.8 = 0.0945 s; concurrency 1 alone is 58% of them.
VLLM_STARTUP = 50.0
VLLM_DECODE_STEP_SECONDS = 0.0945
BATCH_STEP_COST = 0.22
FIT_SHARE = 0.9  # the resize fits the prediction to 90% of the budget: the constants reproduce one run, and the next
# one's probe and steps see other moments of the machine
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
class VllmEval:
    """The demo's evaluation in vLLM: `servers` (the target alone and each served drafter), each decoding every
    prompt of `splits` x `prompts` for `tokens` new tokens at each level of `concurrency`."""

    servers: int
    splits: int
    prompts: int
    tokens: int
    concurrency: tuple[int, ...]

    def seconds(self, rate_gflops: float, concurrency: tuple[int, ...] | None = None) -> float:
        levels = self.concurrency if concurrency is None else concurrency
        steps = self.splits * sum(decode_steps(self.prompts, self.tokens, c) for c in levels)
        return self.servers * (VLLM_STARTUP + steps * VLLM_DECODE_STEP_SECONDS) * CALIBRATION_RATE / rate_gflops


def decode_steps(prompts: int, tokens: int, concurrency: int) -> float:
    """One sweep level's decode steps, in steps of one request: ceil(prompts / concurrency) waves of `tokens`."""
    in_flight = min(concurrency, prompts)
    return math.ceil(prompts / concurrency) * tokens * (1 + BATCH_STEP_COST * (in_flight - 1))


def shorter_sweeps(levels: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The vLLM sweeps the resize tries, longest first: the inner levels dropped one at a time from the top, then
    the highest; the lowest always stays (vLLM's AL and lossless check, on every prompt, are taken there)."""
    levels = tuple(sorted(levels))
    sweeps, inner = [], list(levels[1:-1])
    while inner:
        inner.pop()
        sweeps.append((levels[0], *inner, levels[-1]))
    return sweeps + ([levels[:1]] if len(levels) > 1 else [])


@dataclasses.dataclass(frozen=True)
class Resize:
    """What `resize` decided: the prediction before and after, the vLLM sweep kept, and the scale of each trained
    step's iterations."""

    rate_gflops: float
    budget: float
    predicted: float  # seconds at the configured sizes
    predicted_after: float  # seconds at the sizes chosen
    other: float = 0.0  # of them, the untrained steps' seconds (the evaluation in vLLM at the sweep kept)
    concurrency: tuple[int, ...] | None = None  # the vLLM sweep's levels where they were shortened
    stage2_scale: float = 1.0
    distill_scale: float = 1.0

    @property
    def resized(self) -> bool:
        return self.concurrency is not None or self.stage2_scale < 1.0 or self.distill_scale < 1.0


def untrained_reference_seconds(conversations: int, vllm: bool) -> dict[str, float]:
    """The untrained steps' seconds at CALIBRATION_RATE for `conversations` regenerated training conversations, by
    step (the evaluation in vLLM apart: VllmEval)."""
    if vllm:
        regenerate = VLLM_STARTUP + conversations * VLLM_REGENERATE_SECONDS_PER_CONVERSATION
    else:
        regenerate = conversations * REGENERATE_SECONDS_PER_CONVERSATION
    return {
        "other": OTHER_FIXED_SECONDS,
        "regenerate": regenerate,
        "extract": EXTRACT_STARTUP + conversations * EXTRACT_SECONDS_PER_CONVERSATION,
        "eval": EVAL_SECONDS,
    }


def other_reference_seconds(conversations: int, vllm: bool) -> float:
    """The untrained steps' seconds at CALIBRATION_RATE, the evaluation in vLLM apart."""
    return sum(untrained_reference_seconds(conversations, vllm).values())


def resize(
    rate_gflops: float,
    budget: float,
    steps: list[TrainedStep],
    other_reference: float = 0.0,
    vllm_eval: VllmEval | None = None,
) -> Resize:
    """The longest vLLM sweep, then the largest scales (Stage 2 first, down to STAGE2_FLOOR, then distillation, down
    to DISTILL_FLOOR) whose predicted total fits FIT_SHARE of `budget` seconds at `rate_gflops`, the untrained steps
    taking `other_reference` seconds at CALIBRATION_RATE besides `vllm_eval` (None: the demo serves nothing); nothing
    changes where it already fits. Pure: no clock, no model."""
    if not rate_gflops > 0:
        raise ValueError(f"the measured GEMM rate must be positive, got {rate_gflops}.")
    fit = FIT_SHARE * budget
    fixed = other_reference * CALIBRATION_RATE / rate_gflops
    stage2 = [s for s in steps if s.name == "pretrain"]
    distill = [s for s in steps if s.name != "pretrain"]

    def other(levels) -> float:
        return fixed + (vllm_eval.seconds(rate_gflops, levels) if vllm_eval else 0.0)

    def total(levels, s2: float, d: float) -> float:
        return (
            other(levels)
            + sum(s.seconds(rate_gflops, scaled(s.iterations, s2)) for s in stage2)
            + sum(s.seconds(rate_gflops, scaled(s.iterations, d)) for s in distill)
        )

    levels = vllm_eval.concurrency if vllm_eval else None
    predicted = total(levels, 1.0, 1.0)
    if predicted <= fit:
        return Resize(rate_gflops, budget, predicted, predicted, other(levels))
    sweeps = shorter_sweeps(levels) if vllm_eval else []
    for levels in sweeps:  # the longest that fits, else the shortest
        if total(levels, 1.0, 1.0) <= fit:
            break
    kept = levels if sweeps else None
    s2, d = 1.0, 1.0
    if total(levels, 1.0, 1.0) > fit:
        s2 = _largest_scale(lambda x: total(levels, x, 1.0), fit, STAGE2_FLOOR)
        if total(levels, s2, 1.0) > fit:
            s2 = STAGE2_FLOOR
            d = _largest_scale(lambda x: total(levels, STAGE2_FLOOR, x), fit, DISTILL_FLOOR)
    return Resize(rate_gflops, budget, predicted, total(levels, s2, d), other(levels), kept, s2, d)


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


def demo_vllm_eval(cfg) -> VllmEval:
    """The evaluation in vLLM of a demo of size `cfg` (demo/engine_eval.py): the target alone and seed 0's Osprey and
    EAGLE-3 drafter of each training domain, on every eval prompt, at cfg.vllm_concurrency (else the engine's)."""
    from megatron_osprey.eval.vllm_engine import CONCURRENCY

    return VllmEval(
        servers=1 + 2 * len(cfg.train_domains),
        splits=len(cfg.eval_domains),
        prompts=cfg.n_eval,
        tokens=cfg.eval_tokens,
        concurrency=tuple(cfg.vllm_concurrency or CONCURRENCY),
    )


def predicted_steps(cfg, target, rate_gflops: float, vllm: bool) -> dict[str, float]:
    """Each step's predicted seconds for a demo of size `cfg` at `rate_gflops`, by the names make demo's report
    gives them (a distillation per training domain and seed summed under its method; "other": every other step)."""
    scale = CALIBRATION_RATE / rate_gflops
    out = {k: v * scale for k, v in untrained_reference_seconds(cfg.n_train, vllm).items()}
    for step in demo_trained_steps(cfg, target, cfg.n_train):
        out[step.name] = out.get(step.name, 0.0) + step.seconds(rate_gflops)
    if vllm:
        out["eval_vllm"] = demo_vllm_eval(cfg).seconds(rate_gflops)
    return out


BUDGET_FILE = "budget.json"  # in the demo's output: a resumed run keeps the sizes its first run chose


def fit_to_budget(cfg, target, output, budget: float, threads: int, vllm: bool, say=print):
    """`cfg` resized (Resize) so that its predicted wall time on this machine fits `budget` seconds, with
    `cfg.resized` saying so; one line says the measured rate, the prediction and what changed. A resumed run
    (OUTPUT/budget.json) keeps the sizes its first run chose, so its steps' commands stay the same. `vllm`: the
    demo regenerates and evaluates in vLLM."""
    import json
    from pathlib import Path

    from megatron_osprey.base.atomic_io import write_json_atomic

    record = Path(output) / BUDGET_FILE
    if record.is_file():
        kept = json.loads(record.read_text())
        say(f"budget: resuming with the sizes the first run chose: {kept['line']}")
        levels = kept.get("vllm_concurrency")  # absent from a record written before the vLLM sweep was resized
        return dataclasses.replace(
            cfg,
            backbone_iters=kept["backbone_iters"],
            distill_epochs=kept["distill_epochs"],
            vllm_concurrency=tuple(levels) if levels else None,
            resized=kept["resized"],
        )
    began = time.perf_counter()
    rate = gemm_rate(threads)
    probe = time.perf_counter() - began
    steps = demo_trained_steps(cfg, target, cfg.n_train)
    vllm_eval = demo_vllm_eval(cfg) if vllm else None
    decision = resize(rate, budget, steps, other_reference_seconds(cfg.n_train, vllm), vllm_eval)
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
            "vllm_concurrency": list(fitted.vllm_concurrency) if fitted.vllm_concurrency else None,
        },
    )
    return fitted


def apply(cfg, decision: Resize):
    """`cfg` with the vLLM sweep, Stage 2's iterations and the distillation epochs as `decision` says."""
    return dataclasses.replace(
        cfg,
        backbone_iters=scaled(cfg.backbone_iters, decision.stage2_scale),
        distill_epochs=round(cfg.distill_epochs * decision.distill_scale, 3),
        vllm_concurrency=decision.concurrency or cfg.vllm_concurrency,
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
    if decision.concurrency is not None:
        from megatron_osprey.eval.vllm_engine import CONCURRENCY

        levels = (" ".join(map(str, c)) for c in (before.vllm_concurrency or CONCURRENCY, after.vllm_concurrency))
        changes.append(f"vLLM eval concurrency {' -> '.join(levels)}")
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
