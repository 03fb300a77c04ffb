"""Calibrates demo/budget.py: times a few iterations of each trained step of `make demo` at its shapes (Stage 2
pretraining, Stage 4 distillation of Osprey and EAGLE-3) beside the GEMM probe, and prints each step's efficiency
(achieved FLOP/s over the probe's rate) and startup seconds, and the FLOPs per iteration the stage logged against
the ones demo/budget.py predicts.

    MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OSPREY_CPU_CAPABILITY=avx2 \\
        OMP_NUM_THREADS=2 python benchmarks/demo_budget_calibration.py OUT

Short runs only (6 iterations a step, 12 training conversations regenerated as the demo regenerates them, so
that distillation's batches are as long as the demo's): the figures are per iteration, not the demo's results.
The probe runs before, between and after the steps; under contention its spread says how far to trust them.

    python benchmarks/demo_budget_calibration.py --demo DEMO_OUT [--rate GFLOPS]

reads a finished `make demo` instead (its report.json's per-step seconds, and the probe's rate from its budget.json
unless --rate gives it) and prints each step's seconds beside the model's prediction at that rate, as
demo/budget.py's constants were fitted to one such run (a run with --no-resize writes no budget.json: pass --rate).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import sys
from pathlib import Path

LINE = re.compile(
    r"iteration\s+(\d+)/(\d+) \|.*throughput/tflops_per_gpu: ([0-9.e+-]+).*iteration_time_s: ([0-9.e+-]+)"
)


def _iterations(log: Path) -> list[tuple[int, float, float]]:
    """(iteration, TFLOP/s, seconds) of each logged iteration."""
    found = []
    for line in log.read_text().splitlines():
        match = LINE.search(line)
        if match:
            found.append((int(match[1]), float(match[3]), float(match[4])))
    return found


def _group(step: str) -> str:
    """The name demo/budget.predicted_steps gives a make demo step."""
    for prefix, group in (
        ("pretrain_backbone_target", "pretrain"),
        ("distill_osprey_", "distill_osprey"),
        ("distill_eagle3_", "distill_eagle3"),
        ("regenerate_", "regenerate"),
        ("extract_", "extract"),
    ):
        if step.startswith(prefix):
            return group
    return step if step in ("eval", "eval_vllm") else "other"


def compare_demo(demo: Path, rate: float | None) -> int:
    """A finished make demo's seconds per step beside the model's prediction at its probe's rate."""
    from megatron_osprey.assets.models import get_model_dir
    from megatron_osprey.demo.budget import BUDGET_FILE, predicted_steps
    from megatron_osprey.demo.sizes import TARGET_MODEL, DemoConfig

    report = json.loads((demo / "report.json").read_text())
    if rate is None:
        if not (demo / BUDGET_FILE).is_file():
            print(f"--demo {demo}: no {BUDGET_FILE} (a --no-resize run); pass --rate GFLOPS.", file=sys.stderr)
            return 2
        rate = json.loads((demo / BUDGET_FILE).read_text())["rate_gflops"]
    fields = {f.name for f in dataclasses.fields(DemoConfig)}
    sizes = {k: tuple(v) if isinstance(v, list) else v for k, v in report["config"].items() if k in fields}
    cfg = DemoConfig(**{**sizes, "cross_tokenizer": None})  # the model covers the base arms
    measured: dict[str, float] = {}
    for step, seconds in {**report.get("earlier_step_seconds", {}), **report["step_seconds"]}.items():
        measured[_group(step)] = measured.get(_group(step), 0.0) + seconds
    predicted = predicted_steps(cfg, get_model_dir(TARGET_MODEL), rate, vllm="eval_vllm" in measured)
    print(f"probe {rate:.1f} GFLOP/s; report total {report['seconds']:.0f} s; seconds per step (measured / model):")
    for group in sorted(set(measured) | set(predicted)):
        print(f"  {group:16s} {measured.get(group, 0.0):8.0f} {predicted.get(group, 0.0):8.0f}")
    print(f"  {'total':16s} {sum(measured.values()):8.0f} {sum(predicted.values()):8.0f}")
    return 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--demo":
        import argparse

        parser = argparse.ArgumentParser(description="a finished make demo beside the budget model")
        parser.add_argument("--demo", type=Path, required=True)
        parser.add_argument("--rate", type=float, default=None, help="the probe's GFLOP/s (default: budget.json's)")
        args = parser.parse_args(argv)
        if not (args.demo / "report.json").is_file():
            parser.error(f"--demo {args.demo}: no report.json (not a finished demo run).")
        if args.rate is not None and not args.rate > 0:
            parser.error("--rate must be > 0 GFLOP/s.")
        return compare_demo(args.demo, args.rate)
    from megatron_osprey.base.hardware import cpu_capability
    from megatron_osprey.demo import arms, pipeline
    from megatron_osprey.demo.budget import demo_trained_steps, gemm_rate
    from megatron_osprey.demo.sizes import DemoConfig
    from megatron_osprey.demo.step_runner import StepRunner

    out = Path(argv[0])
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    cpu = cpu_capability(os.environ)
    print(cpu.line(), f"threads {threads}", flush=True)
    cfg = dataclasses.replace(
        DemoConfig.quick(),
        n_train=12,
        n_eval=2,
        eval_domains=("chat",),
        general_chars=60_000,
        backbone_iters=6,
        bf16=cpu.native_bf16,
    )
    rates = [gemm_rate(threads)]
    pipeline.prepare_demo_output(out, cfg)
    steps = StepRunner(out, total_steps=4)
    target = pipeline.fetch_target(steps)
    data = pipeline.prepare_data(steps, cfg, out, target)
    inits = arms.build_backbones(steps, cfg, out, data, target)
    rates.append(gemm_rate(threads))
    regenerated, stores = arms.regenerate_and_extract(steps, cfg, out, data, target, None, False)
    rates.append(gemm_rate(threads))
    arms.distill_drafters(steps, cfg, out, target, inits, regenerated, stores)
    rates.append(gemm_rate(threads))
    rate = statistics.mean(rates)
    predicted = {s.name: s for s in demo_trained_steps(cfg, target, samples=cfg.n_train)}
    names = {"pretrain": "pretrain_backbone_target", "distill_osprey": "distill_osprey_chat"}
    names["distill_eagle3"] = "distill_eagle3_chat"
    figures = {"rate_gflops": rates, "threads": threads, "cpu": cpu.line(), "load": os.getloadavg(), "stages": {}}
    for stage, step in names.items():
        rows = _iterations(out / "logs" / f"{step}.log")
        later = [r for r in rows if r[0] > 1]  # the first iteration carries the warm-up
        seconds = statistics.median(r[2] for r in later)
        tflops = statistics.median(r[1] for r in later)
        total = steps.timings[step]
        figures["stages"][stage] = {
            "iterations": len(rows),
            "seconds_per_iteration": seconds,
            "logged_flops_per_iteration": tflops * 1e12 * seconds,
            "predicted_flops_per_iteration": predicted[stage].flops_per_iteration,
            "efficiency": tflops * 1e3 / rate,
            "startup": total - len(rows) * seconds,
            "step_seconds": total,
        }
    print(json.dumps(figures, indent=2))
    (out / "calibration.json").write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
