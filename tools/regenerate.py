#!/usr/bin/env python
"""Regenerate every assistant turn of a conversations JSONL with the target (megatron_osprey/stages/regenerate.py;
flags: --help). Rerunning the same command resumes.

    python tools/regenerate.py --input prompts.jsonl --output regen.jsonl --backend server --server-url URL
"""

import sys
from pathlib import Path

# Run as a script, Python puts tools/ on sys.path, not the checkout: without this line an installed
# megatron_osprey (an editable install of another checkout, say) would run instead of this one.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_osprey.recipes import run_stage  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_stage("regenerate", sys.argv[1:]))
