#!/usr/bin/env python
"""Profile our side of one `make bench` pair on the bench's own inputs; print the top entries.
    python benchmarks/profile_stage.py STAGE [--quick] [--top 10] [--torch] [--save FILE]
    python benchmarks/profile_stage.py STAGE [--quick] [--top 10] [--torch]

STAGE: preprocessing, extraction or distillation. The pair is built exactly as benchmarks/bench.py builds it; our
side runs once untimed (warm-up), then once under cProfile, whose top entries by cumulative and by self time are
printed. Preprocessing runs as a subprocess (its start-up counts), so it is profiled as one:
`python -m cProfile` over tools/preprocess_data.py for the parent, then one in-process BatchEncoder over the
same corpus batches for a worker's share. `--torch` adds torch.profiler's operators by self CPU time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench import Sizes, build_pair  # noqa: E402

STAGES = ("preprocessing", "extraction", "distillation")


def print_stats(profile_or_path, top: int, title: str) -> None:
    """The top entries of a cProfile run by cumulative, then by self (tottime) seconds."""
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        stats = pstats.Stats(profile_or_path, stream=out)
        stats.strip_dirs().sort_stats(key).print_stats(top)
        body = out.getvalue()
        print(f"--- {title}: top {top} by {key} ---")
        print(body[body.find("   ncalls") :].rstrip() if "   ncalls" in body else body)


def profile_preprocessing(workdir: Path, sizes: Sizes, top: int) -> None:
    from benchmarks.bench_preprocess import _env, ours_command, write_corpus
    from megatron_osprey.assets import get_model_dir
    from megatron_osprey.data.fast_tokenizer import load_tokenizer_spec
    from megatron_osprey.data.text_sources import open_text_source
    from megatron_osprey.data.token_encoding import BatchEncoder

    tokenizer = get_model_dir("smollm2-135m-instruct")
    corpus = workdir / "corpus.jsonl"
    write_corpus(corpus, sizes.corpus_mb)
    command = [str(c) for c in ours_command(corpus, tokenizer, workdir / "ours", 2)]
    out = workdir / "parent.prof"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "cProfile", "-o", str(out), *command], env=_env(), check=True)
    print(f"preprocessing: {time.perf_counter() - start:.3f} s wall for the profiled subprocess")
    print_stats(str(out), top, "preprocessing, the parent process (tools/preprocess_data.py)")
    spec = load_tokenizer_spec(str(tokenizer))
    encoder = BatchEncoder(spec, "text")
    batches = list(open_text_source(str(corpus), "text", "train").batches(1 << 20))
    profile = cProfile.Profile()
    profile.runcall(lambda: [encoder.encode(b) for b in batches])
    print_stats(profile, top, f"preprocessing, one worker's encode of all {len(batches)} batches in one process")


def profile_model_stage(
    name: str, workdir: Path, sizes: Sizes, top: int, use_torch: bool, save=None, bf16: bool = True
) -> None:
    pair = build_pair(name, sizes, workdir, bf16=bf16)
    try:
        pair.ours()  # warm-up, as the bench does
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.runcall(pair.ours)
        print(f"{name}: {time.perf_counter() - start:.3f} s wall under cProfile")
        print_stats(profile, top, name)
        if save:
            profile.dump_stats(save)
        if use_torch:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                pair.ours()
            print(f"--- {name}: torch.profiler, top {top} by self CPU time ---")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    finally:
        if pair.close is not None:
            pair.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("--quick", action="store_true", help="the tiny inputs of `bench.py --quick`")
    parser.add_argument("--top", type=int, default=10, help="entries printed per table")
    parser.add_argument("--torch", action="store_true", help="also torch.profiler's operators (model stages)")
    parser.add_argument("--save", help="model stages: also write the cProfile stats here (for pstats' print_callers)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sizes = Sizes.quick() if args.quick else Sizes()
    with tempfile.TemporaryDirectory(prefix="osprey-profile-") as tmp:
        if args.stage == "preprocessing":
            profile_preprocessing(Path(tmp), sizes, args.top)
        else:
            from megatron_osprey.base.hardware import cpu_capability

            cpu = cpu_capability(os.environ)  # as make bench: bf16 only where the CPU has it natively
            print(cpu.line(), flush=True)
            profile_model_stage(args.stage, Path(tmp), sizes, args.top, args.torch, args.save, cpu.native_bf16)
    return 0


if __name__ == "__main__":
    sys.exit(main())
