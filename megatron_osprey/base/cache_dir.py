"""The project's cache root: $OSPREY_CACHE if set, else ~/.cache/megatron_osprey (one place for the default)."""

from __future__ import annotations

import os
from pathlib import Path


def osprey_cache_dir(kind: str) -> Path:
    """$OSPREY_CACHE/<kind> if OSPREY_CACHE is set, else ~/.cache/megatron_osprey/<kind>."""
    root = os.environ.get("OSPREY_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "megatron_osprey"
    return base / kind
