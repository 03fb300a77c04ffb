#!/usr/bin/env python
"""Stage 1: prune a HF small LM to its first N blocks (megatron_osprey/stages/prune.py; flags: --help).

python tools/prune_backbone.py --source HF_DIR --num-layers 2 --output OUT
"""

import sys
from pathlib import Path

# Run as a script, Python puts tools/ on sys.path, not the checkout: without this line an installed
# megatron_osprey (an editable install of another checkout, say) would run instead of this one.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_osprey.recipes import run_stage  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_stage("prune", sys.argv[1:]))
