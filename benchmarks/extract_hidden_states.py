"""Benchmark hidden-state extraction on this machine: tokens/s, store bytes/token, write speed vs the disk.

Usage:
    python benchmarks/extract_hidden_states.py [--hidden 512] [--layers 8] [--samples 64] [--dir /scratch] \
        [--json out.json]

A random Llama-style target (tiny chat tokenizer) is extracted on one rank
(CPU: float32; GPU: bf16) into a bf16 and an int8 store. Reported: steady-state
extraction tokens/s (the loop, after loading), store bytes/token against
SpecForge's offline format (3 aux + 1 final hidden state in bf16 = 8*Ht bytes),
and the writer alone re-writing the same samples against the disk's
sequential write speed (the store helper's disk probe).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.hidden_state_store import disk_write_mb_s  # noqa: E402
from megatron_osprey.base.arch import ModelArch  # noqa: E402
from megatron_osprey.data.extract import extract_hidden_states  # noqa: E402
from megatron_osprey.data.hidden_state_store import HiddenStateStore, HiddenStateStoreConfig, HiddenStateWriter  # noqa: E402
from megatron_osprey.models.target.config import TargetConfig  # noqa: E402
from megatron_osprey.parallel import ParallelConfig, parallel_context  # noqa: E402
from megatron_osprey.stages.extract import ExtractConfig  # noqa: E402


def write_target(directory: Path, hidden: int, layers: int) -> None:
    from transformers import LlamaConfig

    from megatron_osprey.data.regenerate.tiny_target import build_tiny_tokenizer
    from megatron_osprey.testing.tiny_models import make_hf_model

    tokenizer = build_tiny_tokenizer("qwen3")
    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 256),
        intermediate_size=hidden * 3,
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    make_hf_model(config, directory)
    tokenizer.save_pretrained(str(directory))


def write_long_conversations(path: Path, count: int) -> None:
    from megatron_osprey.testing.tiny_models import write_conversations_jsonl

    write_conversations_jsonl(path, count)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    with open(path, "w") as handle:
        for row in rows:  # ~300-600 tokens each: prefill-sized, not toy-sized
            for turn in row["conversations"]:
                turn["content"] = " ".join([turn["content"]] * 12)
            handle.write(json.dumps(row) + "\n")


def extract(root: Path, data: Path, encoding: str, micro_batch: int) -> dict:
    store = root / f"store-{encoding}"
    steps: list[float] = []
    config = ExtractConfig(
        target=TargetConfig(path=str(root / "target")),
        data_path=str(data),
        micro_batch_size=micro_batch,
        store=HiddenStateStoreConfig(store_dir=str(store), encoding=encoding, samples_per_shard=16),
    )
    arch = ModelArch.from_hf_config(config.target.path)
    with parallel_context(ParallelConfig()) as state:
        result = extract_hidden_states(
            config, state, arch, log=lambda _: None, on_batch=lambda step: steps.append(time.perf_counter())
        )
    manifest = json.loads((store / "manifest.json").read_text())
    loop_seconds = steps[-1] - steps[0]
    # Tokens processed after the first step's timestamp (the first batch's time is not in loop_seconds).
    first_batch_tokens = manifest["num_tokens"] * micro_batch / max(1, result.num_samples)
    return {
        "tokens": manifest["num_tokens"],
        "wall_seconds_incl_load": result.seconds,
        "tokens_per_s_steady": (manifest["num_tokens"] - first_batch_tokens) / loop_seconds if loop_seconds else 0.0,
        "bytes_per_token": manifest["bytes_per_token"],
        "store_bytes": manifest["num_bytes"],
    }


def writer_only_mb_s(root: Path, encoding: str) -> float:
    """Re-write the extracted samples with the writer alone (no model): the store's write ceiling here."""
    source = HiddenStateStore(root / f"store-{encoding}")
    samples = list(source)
    h = source.header
    out = root / f"rewrite-{encoding}"
    start = time.perf_counter()
    with HiddenStateWriter(
        out,
        target_id=h.target_id,
        config_hash=h.config_hash,
        aux_layer_ids=h.aux_layer_ids,
        hidden_size=h.hidden_size,
        encoding=encoding,
        samples_per_shard=16,
        threads=2,
    ) as writer:
        for s in samples:
            writer.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["aux_hidden"], s["final_hidden"])
    elapsed = time.perf_counter() - start
    size = sum(p.stat().st_size for p in out.glob("shard-*"))
    return size / elapsed / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="osprey-extract-bench-", dir=args.dir))
    try:
        write_target(root / "target", args.hidden, args.layers)
        data = root / "conversations.jsonl"
        write_long_conversations(data, args.samples)
        figures = {
            "hidden": args.hidden,
            "layers": args.layers,
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "threads": torch.get_num_threads(),
            "specforge_bytes_per_token": 8 * args.hidden,
        }
        for encoding in ("bf16", "int8"):
            figures[encoding] = extract(root, data, encoding, args.micro_batch_size)
            figures[encoding]["vs_specforge"] = figures[encoding]["bytes_per_token"] / (8 * args.hidden)
            figures[encoding]["writer_only_mb_s"] = writer_only_mb_s(root, encoding)
        figures["disk_seq_write_mb_s"] = disk_write_mb_s(root, 256)
        print(json.dumps(figures, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
