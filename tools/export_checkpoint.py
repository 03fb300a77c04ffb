#!/usr/bin/env python
"""Export a drafter checkpoint for serving (megatron_osprey/stages/export.py; formats and trust: --help).

python tools/export_checkpoint.py --checkpoint CKPT --format sglang|hf|speculators --output DIR [--overwrite]
"""

import sys
from pathlib import Path

# Run as a script, Python puts tools/ on sys.path, not the checkout: without this line an installed
# megatron_osprey (an editable install of another checkout, say) would run instead of this one.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_osprey.recipes import run_stage  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_stage("export", sys.argv[1:]))
