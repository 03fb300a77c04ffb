#!/usr/bin/env python
"""AL and throughput of a running SGLang server (target + drafter) on eval splits, batch 1.

    python tools/sglang_bench.py --url http://127.0.0.1:30000 --tokenizer TARGET_DIR \
        --data SPLIT.jsonl [--data ...] --output DIR --drafter-name NAME [--train-domain DOMAIN] \
        [--method osprey] [--max-new-tokens 256] [--limit N] [--wait 1800]

Prompts are rendered exactly as `python -m megatron_osprey.eval` renders them (target chat template,
conversation up to its first assistant turn, all prompts in file order). AL per request =
completion_tokens / spec_verify_ct from SGLang's meta_info. Writes DIR/results.json, matrix.md,
matrix.png (one row: this drafter).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--tokenizer", required=True, type=Path, help="the target's HF directory (chat template)")
    parser.add_argument("--data", required=True, action="append", type=Path)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--drafter-name", required=True)
    parser.add_argument("--train-domain", default=None)
    parser.add_argument("--method", default="osprey")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the server's /health")
    parser.add_argument("--config-note", action="append", default=[], help="KEY=VALUE recorded in results.json")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from megatron_osprey.eval.matrix import Cell, build_matrices, summarize
    from megatron_osprey.eval.prompts import load_prompts
    from megatron_osprey.eval.run import split_names, write_results
    from megatron_osprey.eval.sglang_client import ServerConfig, bench_prompts, wait_for_server

    try:
        splits = split_names(args.data)
        tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
        prompts = {s: load_prompts(p, tokenizer, args.limit) for s, p in zip(splits, args.data)}
        if args.wait:
            wait_for_server(args.url, args.wait)
        server = ServerConfig(args.url, args.max_new_tokens, args.temperature)
        cells, records = [], []
        with tqdm(total=sum(len(p) for p in prompts.values()), desc="sglang", unit="req") as progress:
            for split in splits:
                requests = bench_prompts(server, prompts[split], progress)
                summary = summarize(requests)
                cells.append(Cell(args.drafter_name, args.method, args.train_domain, split, summary))
                records.append({"drafter": args.drafter_name, "method": args.method, "train_domain": args.train_domain,
                                "split": split, "summary": summary, "requests": requests})
    except (ValueError, FileNotFoundError, TimeoutError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    notes = dict(item.partition("=")[::2] for item in args.config_note)
    results = {
        "format": "megatron_osprey.eval/1",
        "config": {"target": str(args.tokenizer), "server": args.url, "steps": notes.pop("steps", None),
                   "topk": notes.pop("topk", None), "draft_tokens": notes.pop("draft_tokens", None),
                   "temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "limit": args.limit, **notes},
        "drafters": [{"name": args.drafter_name, "method": args.method, "train_domain": args.train_domain,
                      "source": "sglang"}],
        "splits": [{"name": s, "path": str(p), "requests": len(prompts[s])} for s, p in zip(splits, args.data)],
        "cells": records, "matrices": build_matrices(cells, splits),
        "lossless": {"checked": False, "mismatches": []},
    }
    write_results(results, args.output)
    for record in records:
        s = record["summary"]
        print(f"{record['split']}: AL {s['mean_acceptance_length']:.3f} (pooled {s['pooled_acceptance_length']:.3f}), "
              f"{s['tokens_per_s']:.1f} tok/s over {s['requests']} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
