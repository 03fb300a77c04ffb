"""`python -m megatron_osprey.eval`: evaluation shim (megatron_osprey/stages/evaluate.py)."""

import sys

from megatron_osprey.stages.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
