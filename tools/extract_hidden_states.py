#!/usr/bin/env python
"""Extract a target's hidden states for offline distillation (megatron_osprey/stages/extract.py; flags: --help).

    torchrun --nproc_per_node=8 tools/extract_hidden_states.py --target TARGET --data conversations.jsonl \\
        --output STORE [--expert-model-parallel-size 8 --shard i/n ...]
"""

import sys
from pathlib import Path

# Run as a script, Python puts tools/ on sys.path, not the checkout: without this line an installed
# megatron_osprey (an editable install of another checkout, say) would run instead of this one.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_osprey.recipes import run_stage  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_stage("extract", sys.argv[1:]))
