#!/usr/bin/env python
"""Stage 4 throughput: tokens/s and peak memory of a tiny online distillation (CPU here, any device).

    python benchmarks/distill_throughput.py [--iters 20] [--seq-length 128] [--micro-batch-size 4]

Builds the tiny target / adapted drafter of the tests (megatron_osprey/testing/distill_setup.py) in a temp dir, runs
`run_distill` (online target, TTT 5) and prints the steady-state figures of the last log window.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    args = parser.parse_args()

    from megatron_osprey.parallel import parallel_context
    from megatron_osprey.testing.distill_setup import build_distill_setup, tiny_distill_config
    from megatron_osprey.training.distillation import run_distill

    with tempfile.TemporaryDirectory() as tmp:
        setup = build_distill_setup(Path(tmp))
        cfg = tiny_distill_config(
            setup,
            training__train_iters=args.iters,
            training__seq_length=args.seq_length,
            training__micro_batch_size=args.micro_batch_size,
            training__global_batch_size=args.micro_batch_size,
            logging__log_interval=max(1, args.iters // 2),
        )
        with parallel_context(cfg.parallel) as state:
            result = run_distill(cfg, state)
    last = result.history[-1]
    memory_key = next(k for k in last if k.startswith("memory/"))
    print(
        f"distill (online, TTT {cfg.ttt.ttt_steps}, seq {args.seq_length}, micro-batch {args.micro_batch_size}, "
        f"drafter hidden {result.arch.hidden_size}, target hidden {result.arch.target_hidden_size}):"
    )
    print(f"  tokens/s per device: {last['throughput/tokens_per_sec_per_gpu']:.0f}")
    print(f"  iteration time:      {last['throughput/iteration_time_s']:.3f} s")
    print(f"  peak memory:         {last[memory_key]:.2f} GiB ({memory_key})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
