"""`python -m megatron_osprey.distill`: Stage 4 shim (megatron_osprey/stages/distill.py)."""

import sys

from megatron_osprey.stages.distill import main

if __name__ == "__main__":
    # The guard matters: every checkpoint save starts a multiprocessing Manager with spawn.
    sys.exit(main())
