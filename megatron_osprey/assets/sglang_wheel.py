"""The sglang release the SGLang plugin is written against, as a pinned wheel whose Python source tests read."""

from __future__ import annotations

import os
from pathlib import Path

from .download import SOURCES_SUBDIR, fetch_file, resolve_cache_dir
from .sources import Distribution

# The `serve` extra pins sglang==0.5.23. Its wheels are per CPython version, so the tags fix one file
# (the cp311 build; its pure-Python sources are what the tests read, identical in every build).
SGLANG = Distribution(
    package="sglang",
    version="0.5.23",
    filename="sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
    sha256="00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937",
    is_wheel=True,
    wheel_tags=(
        "--python-version",
        "3.11",
        "--implementation",
        "cp",
        "--abi",
        "cp311",
        "--platform",
        "manylinux_2_34_x86_64",
    ),  # fmt: skip
)


def sglang_wheel(cache_dir: str | os.PathLike | None = None) -> Path:
    """The pinned sglang wheel, downloaded once into $OSPREY_CACHE/sglang/_sources and verified on each call."""
    return fetch_file(SGLANG, resolve_cache_dir(cache_dir, "sglang") / SOURCES_SUBDIR)
