"""Tokenize text documents into a Megatron indexed dataset (PREFIX_<key>_document.bin/.idx): the command line.

Usage:
  python -m megatron_osprey.data.preprocess_cli --input data.jsonl.zst --json-key text \
      --tokenizer TOKENIZER_DIR --output-prefix out/fineweb --workers 16 [--partitions 8]
  (python tools/preprocess_data.py takes the same flags)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

# megatron.core's package import warns about training-only extras (TE, apex) that
# tokenization never uses; keep the log to what this tool does.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core\..*")

from megatron_osprey.data.preprocess import PreprocessConfig, preprocess  # noqa: E402


def parse_args(argv=None) -> PreprocessConfig:
    """Parse the command line into a PreprocessConfig."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--input",
        required=True,
        help="JSONL (plain, .gz or .zst), Parquet, a datasets save_to_disk directory, "
        "or a Hugging Face Hub dataset name",
    )
    p.add_argument("--json-key", default="text", help="JSON key / column holding the document text")
    p.add_argument("--split", default="train", help="split to read from a datasets input")
    p.add_argument(
        "--tokenizer",
        required=True,
        help="Hugging Face fast-tokenizer directory (with tokenizer.json) or tokenizer.json",
    )
    p.add_argument("--eod-token", default=None, help="end-of-document token (default: the tokenizer's eos_token)")
    p.add_argument(
        "--no-special-tokens",
        dest="add_special_tokens",
        action="store_false",
        help="do not add the tokenizer's own special tokens (e.g. BOS) to each document",
    )
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_<json-key>_document.bin/.idx")
    p.add_argument(
        "--workers",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 1),
        help="encoding processes, one core each (default: CPUs - 1)",
    )
    p.add_argument(
        "--partitions", type=int, default=1, help="split the input into N resumable partitions, merged at the end"
    )
    p.add_argument("--keep-partitions", action="store_true", help="keep partition files after merging")
    p.add_argument("--strict", action="store_true", help="fail on the first malformed or empty record")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--batch-mb", type=float, default=1.0, help="input megabytes per worker task")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    a = p.parse_args(argv)
    if a.batch_mb <= 0:
        p.error("--batch-mb must be positive")
    return PreprocessConfig(
        input=a.input,
        tokenizer=a.tokenizer,
        output_prefix=a.output_prefix,
        json_key=a.json_key,
        workers=a.workers,
        partitions=a.partitions,
        strict=a.strict,
        overwrite=a.overwrite,
        split=a.split,
        eod_token=a.eod_token,
        add_special_tokens=a.add_special_tokens,
        keep_partitions=a.keep_partitions,
        batch_bytes=int(a.batch_mb * (1 << 20)),
        progress=a.progress,
    )


def main(argv=None) -> int:
    """Run the preprocessing; exit 1 with one error line on bad input."""
    config = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        preprocess(config)
    except (ValueError, KeyError, OSError, ImportError) as err:  # OSError: missing, read-only or full
        msg = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"error: {msg}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
