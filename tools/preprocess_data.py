#!/usr/bin/env python
"""Tokenize text documents into a Megatron indexed dataset (megatron_osprey/stages/preprocess.py; flags: --help).

    python tools/preprocess_data.py --input data.jsonl.zst --json-key text \
        --tokenizer TOKENIZER_DIR --output-prefix out/fineweb --workers 16 [--partitions 8]
"""

import sys
from pathlib import Path

# Run against this checkout's library even where another copy is installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_osprey.recipes import run_stage  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_stage("preprocess", sys.argv[1:]))
