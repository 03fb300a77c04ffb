"""`python -m megatron_osprey.pretrain`: Stage 2 shim (megatron_osprey/stages/pretrain.py)."""

import sys

from megatron_osprey.stages.pretrain import main

if __name__ == "__main__":
    # The guard matters: every checkpoint save starts a multiprocessing Manager with spawn.
    sys.exit(main())
