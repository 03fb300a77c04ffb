#!/usr/bin/env python
"""Stage 3: adapt a pretrained Osprey backbone to a target (megatron_osprey/stages/adapt.py; flags: --help).

python tools/adapt_drafter.py --backbone BACKBONE_DIR --target TARGET_DIR --output OUT
"""

import sys
from pathlib import Path

# Run as a script, Python puts tools/ on sys.path, not the checkout: without this line an installed
# megatron_osprey (an editable install of another checkout, say) would run instead of this one.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_osprey.recipes import run_stage  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_stage("adapt", sys.argv[1:]))
