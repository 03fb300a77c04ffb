"""Benchmark the hidden-state store: bytes/token vs SpecForge, write/read speed vs the disk, int8 loss effect.

Usage:
    python benchmarks/hidden_state_store.py [--sizes 64,4096,8192] [--dir /scratch/tmp] [--json out.json]

The loss figure uses synthetic hidden states with LLM-like statistics (heavy
tails, per-channel gains, a few persistent outlier channels, and massive
activations on the first token of each sample) and a fixed random drafter
that is correlated with the target, so its loss is near the target's entropy
(a relative change is hardest to hide there). Wire the real drafter through
``loss_delta_under_encoding`` for the real figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from megatron_osprey.data.hidden_state_quant import loss_delta_under_encoding
from megatron_osprey.data.hidden_state_store import (
    HiddenStateStore,
    HiddenStateWriter,
    estimate_store_bytes,
    finalize_store,
)

AUX_LAYER_IDS = (1, 17, 32)
LAYER_SCALES = (0.5, 2.0, 6.0)  # residual-stream magnitude grows with depth


def heavy_tailed(shape, generator, df: float = 5.0) -> torch.Tensor:
    """Unit-variance Student-t samples."""
    normal = torch.randn(shape, generator=generator)
    chi2 = torch._standard_gamma(torch.full(shape[-1:], df / 2).expand(shape).contiguous(), generator=generator) * 2
    return normal / torch.sqrt(chi2 / df) / (df / (df - 2)) ** 0.5


def synthetic_samples(num_samples: int, tokens: int, hidden: int, seed: int, realistic: bool = True) -> list[dict]:
    """Samples whose aux/final hidden states look like an LLM's (or plain Gaussian if not ``realistic``)."""
    g = torch.Generator().manual_seed(seed)
    gains = torch.exp(0.4 * torch.randn(hidden, generator=g))
    outliers = torch.randperm(hidden, generator=g)[: max(1, hidden // 700)]
    samples = []
    for i in range(num_samples):
        layers = []
        for scale in LAYER_SCALES + (1.5,):
            if not realistic:
                layers.append(torch.randn(tokens, hidden, generator=g) * scale)
                continue
            x = heavy_tailed((tokens, hidden), g) * gains * scale
            x[:, outliers] *= 25.0  # persistent outlier channels
            x[0, outliers[:2]] = 800.0 * scale  # attention-sink token's massive activation
            layers.append(x)
        low, mid, high, noise = layers
        final = high + 0.5 * mid + noise
        samples.append(
            {
                "sample_id": f"b{i}",
                "input_ids": torch.randint(0, 150_000, (tokens,), generator=g),
                "loss_mask": torch.ones(tokens, dtype=torch.bool),
                "aux_hidden": torch.cat([low, mid, high], dim=1),
                "final_hidden": final,
            }
        )
    return samples


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def make_soft_ce(hidden: int, vocab: int, seed: int):
    """A TTT-style soft CE: fixed random drafter head vs. target softmax recomputed from final hidden states."""
    g = torch.Generator().manual_seed(seed)
    lm_head = torch.randn(hidden, vocab, generator=g) * (4.0 / hidden**0.5)
    draft_head = lm_head + torch.randn(hidden, vocab, generator=g) * (1.0 / hidden**0.5)
    fuse = [m * torch.exp(0.2 * torch.randn(hidden, generator=g)) for m in (0.1, 0.5, 1.0)]

    def soft_ce(sample) -> torch.Tensor:
        aux = sample["aux_hidden"].float()
        final = sample["final_hidden"].float()
        target = torch.softmax(_rms_norm(final) @ lm_head, dim=-1)
        fused = sum(f * aux[:, j * hidden : (j + 1) * hidden] for j, f in enumerate(fuse))
        draft = torch.log_softmax(_rms_norm(fused) @ draft_head, dim=-1)
        mask = sample["loss_mask"]
        return -(target * draft).sum(-1)[mask].mean()

    return soft_ce


def disk_write_mb_s(directory: Path, megabytes: int) -> float:
    """Sequential write speed of a plain file with a final fsync."""
    chunk = os.urandom(16 << 20)
    path = directory / "disk-speed.bin"
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, megabytes // 16)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    size = path.stat().st_size
    path.unlink()
    return size / elapsed / 1e6


def write_store(
    directory: Path, samples: list[dict], hidden: int, encoding: str, threads: int = 0
) -> tuple[dict, float, float]:
    """Write and finalize a store; return its manifest, the writer's wall time and the time spent inside add()."""
    start = time.perf_counter()
    in_add = 0.0
    with HiddenStateWriter(
        directory,
        target_id="bench",
        config_hash="0",
        aux_layer_ids=AUX_LAYER_IDS,
        hidden_size=hidden,
        encoding=encoding,
        samples_per_shard=4,
        threads=threads,
    ) as writer:
        for s in samples:
            t0 = time.perf_counter()
            writer.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["aux_hidden"], s["final_hidden"])
            in_add += time.perf_counter() - t0
    elapsed = time.perf_counter() - start
    return json.loads(finalize_store(directory).read_text()), elapsed, in_add


def bench_size(root: Path, hidden: int, tokens: int, vocab: int, results: dict) -> None:
    """Bytes/token and loss effect for one hidden size."""
    specforge = 8 * hidden
    samples = synthetic_samples(2, tokens // 2, hidden, seed=hidden)
    gaussian = synthetic_samples(2, tokens // 2, hidden, seed=hidden + 1, realistic=False)
    row = {"hidden": hidden, "specforge_bytes_per_token": specforge}
    for encoding in ("bf16", "int8"):
        for kind, data in (("llm_like", samples), ("gaussian", gaussian)):
            manifest, _, _ = write_store(root / f"{encoding}-{kind}-{hidden}", data, hidden, encoding)
            bpt = manifest["bytes_per_token"]
            row[f"{encoding}_{kind}_bytes_per_token"] = bpt
            row[f"{encoding}_{kind}_ratio"] = bpt / specforge
            print(
                f"  Ht={hidden:5d} {encoding:4s} {kind:8s}: {bpt:10.1f} bytes/token = {bpt / specforge:.4f} x "
                f"SpecForge (estimate_store_bytes bound "
                f"{estimate_store_bytes(tokens, hidden, encoding, num_samples=2) / tokens:.0f})"
            )
    loss_fn = make_soft_ce(hidden, vocab, seed=7)
    for encoding, k in (("bf16", 8), ("int8", 8), ("int8", 0)):
        d = loss_delta_under_encoding(loss_fn, samples, encoding, outliers_per_token=k)
        label = encoding if encoding == "bf16" else f"int8 k={k}"
        row[f"loss_{label.replace(' ', '_')}"] = {
            "exact": d.exact_loss,
            "encoded": d.encoded_loss,
            "relative_change": d.relative_change,
            "max_sample_relative_change": d.max_sample_relative_change,
        }
        note = "" if (encoding, k) != ("int8", 0) else "  (ablation: no exact outliers)"
        print(
            f"  Ht={hidden:5d} soft CE {label:10s}: exact {d.exact_loss:.4f} -> {d.encoded_loss:.4f}, "
            f"relative change {d.relative_change:+.3%} (worst sample {d.max_sample_relative_change:.3%}){note}"
        )
    results["sizes"].append(row)


def bench_read(store_dir: Path, encoding: str, ntok: int, threads_max: int) -> dict:
    """Reader speed (page cache warm, so this is CPU cost, not disk) in a few modes."""
    modes = [
        ("sha256 verify + decode", {}, 1),
        ("decode", {"verify_sha256": False}, 1),
        (f"decode, {threads_max} workers", {"verify_sha256": False}, threads_max),
    ]
    if encoding == "int8":
        modes.append(("zstd only, dequantize on device", {"verify_sha256": False, "dequantize": False}, 1))
    out = {}
    for label, kwargs, workers in modes:
        start = time.perf_counter()
        for _ in HiddenStateStore(store_dir, **kwargs).iter_samples(prefetch=4, workers=workers):
            pass
        out[label] = ntok / (time.perf_counter() - start)
        print(f"    {encoding:4s} read, {label:32s}: {out[label]:8.0f} tokens/s")
    return out


def bench_throughput(root: Path, hidden: int, tokens: int, disk_mb: int, threads_max: int, results: dict) -> None:
    """Writer and reader speed at one hidden size, next to the disk's plain sequential write speed."""
    # Best of three, and best of two writer runs below: on a shared machine the
    # slow runs measure the neighbours, not the disk or the code.
    disk = max(disk_write_mb_s(root, disk_mb) for _ in range(3))
    print(f"  disk sequential write + fsync ({disk_mb} MB, best of 3): {disk:8.1f} MB/s")
    results["disk_write_mb_s"] = disk
    per_sample = 1024
    samples = synthetic_samples(max(1, tokens // per_sample), per_sample, hidden, seed=11)
    for encoding in ("bf16", "int8"):
        for threads in (0, threads_max):
            store_dir = root / f"throughput-{encoding}-{threads}"
            runs = []
            for _ in range(2):
                shutil.rmtree(store_dir, ignore_errors=True)
                runs.append(write_store(store_dir, samples, hidden, encoding, threads))
            manifest, elapsed, in_add = min(runs, key=lambda run: run[1])
            ntok = manifest["num_tokens"]
            written = manifest["num_bytes"] / elapsed / 1e6
            specforge_equiv = ntok * 8 * hidden / elapsed / 1e6
            row = {
                "tokens_per_s": ntok / elapsed,
                "disk_mb_s": written,
                "bf16_equivalent_mb_s": specforge_equiv,
                "add_blocking_tokens_per_s": ntok / in_add,
            }
            print(
                f"  Ht={hidden} {encoding:4s} write (best of 2), threads={threads}: {ntok / elapsed:7.0f} tokens/s, "
                f"{written:6.1f} MB/s to disk ({written / disk:4.0%} of plain write), "
                f"{specforge_equiv:6.1f} MB/s of bf16 hidden states; add() blocks at {ntok / in_add:7.0f} tokens/s"
            )
            if threads == 0:
                row["read_tokens_per_s"] = bench_read(store_dir, encoding, ntok, threads_max)
            results[f"write_{encoding}_threads{threads}"] = row
            shutil.rmtree(store_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,4096,8192", help="comma-separated target hidden sizes")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per size for bytes/token and loss figures")
    parser.add_argument("--vocab", type=int, default=16384, help="vocabulary of the synthetic LM heads")
    parser.add_argument("--throughput-hidden", type=int, default=4096)
    parser.add_argument("--throughput-tokens", type=int, default=8192)
    parser.add_argument("--disk-mb", type=int, default=512, help="size of the plain sequential-write probe")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="writer threads for the threaded run")
    parser.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: system temp)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args()
    torch.manual_seed(0)
    results: dict = {"sizes": [], "threads": torch.get_num_threads()}
    root = Path(tempfile.mkdtemp(prefix="hidden-state-bench-", dir=args.dir))
    try:
        print("bytes/token (SpecForge = 8*Ht) and TTT-style soft CE change:")
        for hidden in (int(h) for h in args.sizes.split(",")):
            bench_size(root, hidden, args.tokens, args.vocab, results)
        print("throughput:")
        bench_throughput(root, args.throughput_hidden, args.throughput_tokens, args.disk_mb, args.threads, results)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
