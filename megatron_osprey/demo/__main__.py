"""python -m megatron_osprey.demo [--full | --smoke] [--cross-tokenizer] [--arms all|ARM ...]
[--regenerate-temperature T] [--time-budget MIN | --no-resize] [--output demo_out] [--fresh]: the Osprey pipeline
on a real target."""

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from megatron_osprey.demo.sizes import EXTRA_ARMS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="The whole Osprey pipeline on SmolLM2-135M-Instruct, on CPU.")
    parser.add_argument("--output", type=Path, default=Path("demo_out"))
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--full",
        action="store_true",
        help="two training domains, 3 seeds per arm, cross-tokenizer arm, 32 prompts x 128 tokens per "
        "eval domain (AL replayed; seed 0 also decoded live)",
    )
    size.add_argument("--smoke", action="store_true", help="every stage at the smallest size (minutes)")
    parser.add_argument(
        "--cross-tokenizer",
        action="store_true",
        help="add the cross-tokenizer arm (a small LM with the Llama-3 tokenizer, adapted to the "
        "target's vocabulary) to a quick or smoke run; --full always has it",
    )
    parser.add_argument(
        "--arms",
        nargs="+",
        default=None,
        metavar="ARM",
        help="add extra arms to a quick or smoke run ('all', or any of: " + ", ".join(EXTRA_ARMS) + "); --full "
        "has them all. A finished run resumes with more arms.",
    )
    _add_run_flags(parser)
    args = parser.parse_args(argv)
    from megatron_osprey.base.hardware import cpu_capability
    from megatron_osprey.demo.pipeline import run_demo
    from megatron_osprey.demo.sizes import DemoConfig

    try:
        cpu = cpu_capability(os.environ)
    except ValueError as error:
        parser.error(str(error))
    cfg = DemoConfig.full() if args.full else DemoConfig.smoke() if args.smoke else DemoConfig.quick()
    # bf16 only where the CPU computes it natively: emulated, a bf16 matmul is ~50x slower than float32.
    cfg = dataclasses.replace(cfg, bf16=cfg.bf16 and cpu.native_bf16)
    print(cpu.line(), flush=True)
    if args.cross_tokenizer:
        cfg = cfg.with_cross_tokenizer()
    if args.arms:
        try:
            cfg = cfg.with_arms(args.arms)
        except ValueError as error:
            parser.error(str(error))
    if args.regenerate_temperature is not None:
        if args.regenerate_temperature < 0:
            parser.error("--regenerate-temperature must be >= 0 (0: greedy).")
        cfg = dataclasses.replace(cfg, regenerate_temperature=args.regenerate_temperature)
    budget = _budget_seconds(parser, args, float32=not cfg.bf16)
    try:
        # The serving engine: VLLM_PYTHON, else the repository's .venv-vllm; it regenerates the training data and
        # serves the drafters beside the reference engine. None installed: in-process regeneration, one report line.
        vllm_python = os.environ.get("VLLM_PYTHON")
        report = run_demo(cfg, args.output, fresh=args.fresh, vllm_python=vllm_python, serve=True, budget=budget)
    except RuntimeError as error:
        print(f"demo failed: {error}", file=sys.stderr)
        return 1
    print((args.output / "report.md").read_text())
    gain = (report.get("osprey_gain_over_eagle3") or {}).get("mean")
    resized = (report.get("config") or {}).get("resized")
    print(
        f"demo: wrote {args.output}/report.md, report.json and heatmap.png "
        f"(Osprey vs EAGLE-3 mean AL gain {100 * (gain or 0):+.1f}%"
        + ("; RESIZED to fit the time budget, see report.md)" if resized else ")")
    )
    return 0


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of how the run goes: regeneration's temperature, resuming, the time budget."""
    parser.add_argument(
        "--regenerate-temperature",
        type=float,
        default=None,
        metavar="T",
        help="the target's sampling temperature when it regenerates the training conversations (default 1.0, "
        "the Osprey release's, seeded; 0: greedy)",
    )
    parser.add_argument(
        "--fresh", action="store_true", help="replace a previous demo run in --output instead of resuming it"
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="MIN",
        help="the wall-time budget a quick run (make demo) is fitted to by a few-second GEMM probe of this machine "
        "(default 30; the other sizes are not resized unless it is given)",
    )
    budget.add_argument(
        "--no-resize", action="store_true", help="keep the configured sizes whatever the probe predicts"
    )


def _budget_seconds(parser: argparse.ArgumentParser, args, float32: bool) -> float | None:
    """The budget the run is fitted to (seconds), or None: make demo's promise is 30 minutes, so its base size is
    fitted to it on a CPU that computes it in float32 (the path the model is calibrated on) unless --no-resize; a
    larger run, or a native-bf16 CPU, only when asked (the prediction covers the base arms, in float32)."""
    from megatron_osprey.demo.budget import BUDGET_SECONDS

    if args.time_budget is not None and not args.time_budget > 0:
        parser.error("--time-budget must be > 0 minutes.")
    if args.no_resize:
        return None
    quick = float32 and not (args.full or args.smoke or args.arms or args.cross_tokenizer)
    return 60 * args.time_budget if args.time_budget else BUDGET_SECONDS if quick else None


if __name__ == "__main__":
    raise SystemExit(main())
