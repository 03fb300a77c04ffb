#!/usr/bin/env python
"""`make bench`: every stage timed against its nearest peer and its physical limit, side by side in one run.

    python benchmarks/bench.py [--quick] [--runs 3] [--output bench_out] [--only PAIR ...]

PAIR: preprocessing, extraction, distillation, decoding, speculative (all by default).

Pairs run alternately in this process tree (benchmarks/bench_harness.py); one table is printed and
OUTPUT/bench.json written (rows: stage, ours_s, peer_s, ratio = peer_s / ours_s, limit_s, share_of_limit).
`--quick` uses tiny inputs (the harness test); the default sizes fit 20 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_harness import format_table, run_pair, write_json  # noqa: E402

PAIRS = ("preprocessing", "extraction", "distillation", "decoding", "speculative")


@dataclass(frozen=True)
class Sizes:
    """Input sizes of one bench run."""

    corpus_mb: float = 8.0
    extract_samples: int = 16
    extract_batch: int = 4
    distill_batch: int = 4  # one global batch of this many conversations per update
    distill_seq: int = 256
    decode_prompts: int = 4
    decode_tokens: int = 32
    spec_prompts: int = 4
    spec_tokens: int = 16  # an untrained drafter: every round commits one token, so 5 drafter passes per token

    @classmethod
    def quick(cls) -> "Sizes":
        return cls(
            corpus_mb=0.05,
            extract_samples=2,
            extract_batch=2,
            distill_batch=2,
            distill_seq=128,
            decode_prompts=2,
            decode_tokens=4,
            spec_prompts=2,
            spec_tokens=4,
        )


def build_pair(name: str, sizes: Sizes, workdir: Path, bf16: bool = True):
    """The named Pair, its inputs prepared under workdir; `bf16`: the distillation step computes in bf16 (the CPU
    has it natively), else in float32."""
    if name == "preprocessing":
        from benchmarks.bench_preprocess import preprocess_pair
        from megatron_osprey.assets import get_model_dir

        return preprocess_pair(workdir / name, get_model_dir("smollm2-135m-instruct"), sizes.corpus_mb)
    if name == "extraction":
        from benchmarks.bench_models import extraction_pair

        (workdir / name).mkdir(parents=True, exist_ok=True)
        return extraction_pair(workdir / name, sizes.extract_samples, sizes.extract_batch)
    if name in ("distillation", "speculative"):
        from benchmarks.bench_models import adapted_drafter
        from megatron_osprey.assets import get_model_dir

        target = get_model_dir("smollm2-135m-instruct")
        drafter = adapted_drafter(workdir / "drafter", target)  # the two pairs share it
        if name == "distillation":
            from benchmarks.bench_distill import distill_pair

            return distill_pair(workdir / name, target, drafter, sizes.distill_batch, sizes.distill_seq, bf16)
        from benchmarks.bench_models import speculative_pair

        return speculative_pair(target, drafter, sizes.spec_prompts, sizes.spec_tokens)
    if name == "decoding":
        from benchmarks.bench_models import greedy_pair

        return greedy_pair(sizes.decode_prompts, sizes.decode_tokens)
    raise ValueError(f"--only: unknown pair {name!r}; expected some of {', '.join(PAIRS)}.")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny inputs (seconds of work per pair)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each side (median and spread)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds before the timed ones")
    parser.add_argument("--output", default="bench_out", help="where bench.json goes")
    parser.add_argument("--only", nargs="+", default=list(PAIRS), choices=PAIRS)
    args = parser.parse_args(argv)
    if args.runs < 1 or args.warmup < 0:
        parser.error("--runs must be at least 1 and --warmup at least 0.")
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    from megatron_osprey.base.hardware import cpu_capability

    try:
        cpu = cpu_capability(os.environ)  # OSPREY_CPU_CAPABILITY forces it
    except ValueError as error:
        parser.error(str(error))
    print(cpu.line(), flush=True)
    sizes = Sizes.quick() if args.quick else Sizes()
    workdir = Path(tempfile.mkdtemp(prefix="osprey-bench-"))
    rows = []
    try:
        for name in args.only:
            print(f"[bench] {name}", flush=True)
            pair = build_pair(name, sizes, workdir, bf16=cpu.native_bf16)
            rows.append(run_pair(pair, runs=args.runs, warmup=args.warmup))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(format_table(rows))
    path = write_json(rows, Path(args.output) / "bench.json")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
