#!/usr/bin/env python
"""Peak memory of one layer's K-step TTT attention, forward + backward: exact mask vs memory-linear.

    python benchmarks/ttt_attention_memory.py [--seq 512 1024 2048 4096] [--steps 1 3 5]
                                              [--heads 8 --kv-heads 2 --head-dim 64] [--device cpu|cuda]

Each (impl, seq, K) runs in a fresh process. On CPU the peak is the process's peak
resident memory (VmHWM, reset once the inputs exist) minus the resident memory at that point, with
glibc's mmap threshold pinned at 64 KiB so that freed tensors leave the process
(the default dynamic threshold keeps freed blocks resident and hides the peak). On
CUDA it is torch.cuda.max_memory_allocated beyond the inputs. "exact" is the
masked softmax over all steps' concatenated keys (the attention the drafter used
before), "linear" is `models.ttt_attention.ttt_attention`. One JSON line per run,
then a table; `plan` is `ttt_attention_bytes`, what `osprey plan` budgets.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MIB = 1 << 20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pin_mmap_threshold() -> None:
    """glibc: serve allocations >= 64 KiB by mmap, so that freed tensors leave the process (M_MMAP_THRESHOLD)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 65536)
    except OSError:  # not glibc: the measurement may then include retained free blocks
        pass


def _reset_peak_rss() -> None:
    """Reset this process's resident high-water mark (VmHWM) to its current RSS (Linux clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _peak_rss_bytes() -> int:
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork and exec, so a child would report
    # its parent's peak; VmHWM belongs to this address space and clear_refs resets it.
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(
    impl: str, seq: int, steps: int, heads: int, kv_heads: int, head_dim: int, device: str, dtype_name: str = "float32"
) -> dict:
    """Peak bytes of a `steps`-step unroll of one attention layer (forward + backward), in this process."""
    import torch

    from megatron_osprey.models.drafter.ttt_attention import exact_ttt_attention, ttt_attention

    fn = {"exact": exact_ttt_attention, "linear": ttt_attention}[impl]
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    make = lambda h: torch.randn(1, h, seq, head_dim, generator=gen).to(device, dtype).requires_grad_()  # noqa: E731
    queries = [make(heads) for _ in range(steps)]
    keys = [make(kv_heads) for _ in range(steps)]
    values = [make(kv_heads) for _ in range(steps)]
    scale = head_dim**-0.5
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        _pin_mmap_threshold()
        _reset_peak_rss()
        base = _rss_bytes()
    total = 0
    for k in range(steps):
        total = total + fn(queries[k], keys[: k + 1], values[: k + 1], scale).float().sum()
    total.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _peak_rss_bytes() - base
    return {
        "impl": impl,
        "seq": seq,
        "steps": steps,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": dtype_name,
        "device": device,
        "peak_mib": round(peak / MIB, 1),
    }


def run_child(impl: str, seq: int, steps: int, args) -> dict:
    """`measure` in a fresh process (a process's peak RSS only grows)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [
        sys.executable,
        __file__,
        "--child",
        impl,
        "--seq",
        str(seq),
        "--steps",
        str(steps),
        "--heads",
        str(args.heads),
        "--kv-heads",
        str(args.kv_heads),
        "--head-dim",
        str(args.head_dim),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
    ]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 3, 5])
    parser.add_argument("--impl", nargs="+", default=["exact", "linear"], choices=["exact", "linear"])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(
            json.dumps(
                measure(
                    args.child,
                    args.seq[0],
                    args.steps[0],
                    args.heads,
                    args.kv_heads,
                    args.head_dim,
                    args.device,
                    args.dtype,
                )
            )
        )
        return 0
    from megatron_osprey.base.memory import ttt_attention_bytes

    rows = []
    for steps in args.steps:
        for seq in args.seq:
            for impl in args.impl:
                row = run_child(impl, seq, steps, args)
                dtype_bytes = 4 if args.dtype == "float32" else 2
                row["plan_mib"] = round(
                    ttt_attention_bytes(1, args.heads, seq, args.head_dim, steps, dtype_bytes, args.kv_heads) / MIB, 1
                )
                print(json.dumps(row), flush=True)
                rows.append(row)
    print(f"\n{'K':>2} {'seq':>6} " + " ".join(f"{impl + ' MiB':>12}" for impl in args.impl) + f" {'plan MiB':>10}")
    for steps in args.steps:
        for seq in args.seq:
            cells = {r["impl"]: r for r in rows if r["seq"] == seq and r["steps"] == steps}
            plan = next(iter(cells.values()))["plan_mib"]
            print(f"{steps:>2} {seq:>6} " + " ".join(f"{cells[i]['peak_mib']:>12}" for i in args.impl) + f" {plan:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
