#!/usr/bin/env python
"""AL and throughput of a running SGLang server (target + drafter) on eval splits.

    python tools/sglang_bench.py --url http://127.0.0.1:30000 --tokenizer TARGET_DIR \
        --data SPLIT.jsonl [--data ...] --output DIR --drafter-name NAME [--train-domain DOMAIN] \
        [--method osprey] [--target-only] [--max-new-tokens 4096] [--temperature 0 [1]] [--batch-size 1 [16]] \
        [--limit N] [--wait 1800]

Prompts are rendered exactly as `python -m megatron_osprey evaluate` renders them (target chat template,
the first user message by default, all prompts in file order); a multi-turn row (an MT-Bench set of `osprey suite`)
sends its second turn after the server's answer to the first, as the release's benchmarker does, each turn a
request (`--first-turn-only` sets send the first alone). AL per request = completion_tokens /
spec_verify_ct from SGLang's meta_info (1 with --target-only, whose server drafts nothing); throughput =
completion tokens / wall time with `--batch-size` requests in flight. `--temperature` and `--batch-size` take
lists: every combination is one sweep row (sampling at T > 0 is the server's lossless rejection sampling). Writes
DIR/results.json, matrix.md, matrix.png (the first combination's matrix; the sweep table in matrix.md).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
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
    parser.add_argument(
        "--target-only",
        action="store_true",
        help="the server runs the target alone (no --speculative-algorithm): AL 1, tokens/s is the speedup's baseline",
    )
    parser.add_argument("--max-new-tokens", type=int, default=4096, help="the paper's benchmark: 4096")
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0], help="one or more (a sweep)")
    parser.add_argument(
        "--batch-size",
        type=int,
        nargs="+",
        default=[1],
        help="requests in flight at once; one or more (the paper reports 1 and 16)",
    )
    parser.add_argument("--prompt-messages", choices=("first_user", "before_assistant"), default="first_user")
    parser.add_argument("--seed", type=int, default=None, help="the server's --random-seed, recorded with sampled rows")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the server's /health")
    parser.add_argument("--config-note", action="append", default=[], help="KEY=VALUE recorded in results.json")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from megatron_osprey.eval.prompts import follow_up, load_prompts
    from megatron_osprey.eval.run import split_names, sweep_markdown, write_results
    from megatron_osprey.eval.sglang_client import wait_for_server

    try:
        if any(b < 1 for b in args.batch_size):
            raise ValueError(f"--batch-size values must be >= 1, got {args.batch_size}.")
        splits = split_names(args.data)
        tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
        prompts = {
            s: load_prompts(p, tokenizer, args.limit, mode=args.prompt_messages) for s, p in zip(splits, args.data)
        }
        if args.wait:
            wait_for_server(args.url, args.wait)
        sweep, records = _sweep(args, splits, prompts, functools.partial(follow_up, tokenizer=tokenizer))
    except (ValueError, FileNotFoundError, TimeoutError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    write_results(_results(args, splits, prompts, sweep, records), args.output)
    for record in records:
        s = record["summary"]
        print(
            f"T={record['temperature']:g} batch {record['batch_size']} {record['split']}: "
            f"AL {s['mean_acceptance_length']:.3f} (pooled {s['pooled_acceptance_length']:.3f}), "
            f"{s['throughput_tokens_per_s']:.1f} tok/s over {s['requests']} requests"
        )
    if len(sweep) > 1:
        print(sweep_markdown(sweep, column="batch_size"))
    return 0


def _sweep(args, splits: list[str], prompts: dict, next_turn) -> tuple[list[dict], list[dict]]:
    """Every (temperature, batch size) over every split against the server: the sweep rows and the cells
    (`next_turn` renders a multi-turn row's next turn after the server's answer)."""
    from tqdm import tqdm

    from megatron_osprey.eval.matrix import Cell, build_matrices, summarize
    from megatron_osprey.eval.sglang_client import ServerConfig, bench_prompts, throughput

    combos = [(t, b) for t in args.temperature for b in args.batch_size]
    sweep, records = [], []
    total = len(combos) * sum(1 + len(p.next_turns) for ps in prompts.values() for p in ps)  # requests: every turn
    with tqdm(total=total, desc="sglang", unit="req") as progress:
        for temperature, batch_size in combos:
            server = ServerConfig(args.url, args.max_new_tokens, temperature)
            cells = []
            for split in splits:
                start = time.perf_counter()
                requests = bench_prompts(
                    server,
                    prompts[split],
                    progress,
                    batch_size=batch_size,
                    speculative=not args.target_only,
                    next_turn=next_turn,
                )
                wall = time.perf_counter() - start
                summary = {
                    **summarize(requests),
                    "wall_seconds": wall,
                    "throughput_tokens_per_s": throughput(requests, wall),
                }
                cells.append(Cell(args.drafter_name, args.method, args.train_domain, split, summary))
                drafter = {"drafter": args.drafter_name, "method": args.method, "train_domain": args.train_domain}
                records.append(
                    {**drafter, "split": split, "temperature": temperature, "batch_size": batch_size, "seed": args.seed,
                     "summary": summary, "requests": requests}
                )  # fmt: skip
            sweep.append(
                {
                    "temperature": temperature,
                    "batch_size": batch_size,
                    "seed": args.seed,
                    "sampling": "greedy" if temperature == 0 else "lossless rejection sampling",
                    "matrices": build_matrices(cells, splits),
                }
            )
    return sweep, records


def _results(args, splits: list[str], prompts: dict, sweep: list[dict], records: list[dict]) -> dict:
    """results.json in the evaluate stage's format (the server's draft shape from --config-note)."""
    notes = dict(item.partition("=")[::2] for item in args.config_note)
    steps, topk, draft_tokens = notes.pop("steps", None), notes.pop("topk", None), notes.pop("draft_tokens", None)
    for row in sweep:  # the server's draft shape is fixed for the whole run
        row.update(steps=steps, topk=topk, draft_tokens=draft_tokens)
    return {
        "format": "megatron_osprey.eval/1",
        "config": {
            "target": str(args.tokenizer),
            "server": args.url,
            "steps": steps,
            "topk": topk,
            "draft_tokens": draft_tokens,
            "temperature": args.temperature[0],
            "batch_size": args.batch_size[0],
            "sweep_temperature": args.temperature,
            "sweep_batch_size": args.batch_size,
            "seed": args.seed,
            "max_new_tokens": args.max_new_tokens,
            "prompt_messages": args.prompt_messages,
            "limit": args.limit,
            **notes,
        },
        "drafters": [
            {"name": args.drafter_name, "method": args.method, "train_domain": args.train_domain, "source": "sglang"}
        ],
        "splits": [{"name": s, "path": str(p), "requests": len(prompts[s])} for s, p in zip(splits, args.data)],
        "cells": records,
        "matrices": sweep[0]["matrices"],
        "sweep": sweep,
        "lossless": {"checked": False, "mismatches": []},
    }


if __name__ == "__main__":
    sys.exit(main())
