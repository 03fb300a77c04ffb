"""What a CUDA machine without Transformer Engine, or without a C compiler, cannot build: refused at start
(and by `osprey plan`) with the missing piece named, instead of a NameError or an assert at step 1."""

from __future__ import annotations

import logging
import shutil
import sysconfig
from pathlib import Path

logger = logging.getLogger(__name__)

C_COMPILERS = ("cc", "gcc", "clang")


def c_compiler() -> str | None:
    """Path of the C compiler Inductor would call (its CC variable aside), or None."""
    for name in C_COMPILERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def python_header() -> str | None:
    """Path of this interpreter's Python.h (sysconfig's include directory), or None."""
    path = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return str(path) if path.is_file() else None


def fusions_usable(on_gpu: bool) -> bool:
    """Megatron-Core compiles its bias-activation and bias-dropout fusions with torch.compile (Inductor and
    Triton), whose launcher build needs a C compiler and Python.h; without either they stay off, said once,
    instead of crashing at step 1."""
    if not on_gpu:
        return False
    if c_compiler() is None:
        logger.warning(
            "no C compiler (cc, gcc or clang) on PATH, which torch.compile needs: Megatron-Core's "
            "bias-activation and bias-dropout fusions are off (install gcc to turn them on)."
        )
        return False
    if python_header() is None:
        logger.warning(
            "no Python.h in %s, which Triton's launcher build needs: Megatron-Core's bias-activation and "
            "bias-dropout fusions are off (install the python3-dev package of this Python to turn them on).",
            sysconfig.get_paths()["include"],
        )
        return False
    return True


def refuse_without_transformer_engine(
    *, is_moe: bool, sequence_parallel: bool, transformer_impl: str, cuda_available: bool
) -> None:
    """Raise ValueError for what the local (non-TE) spec cannot run on CUDA with megatron-core 0.16.1.

    On CUDA the CPU compatibility layer is off, and then the MoE router reads `te_general_gemm` (defined only
    when TE imports: NameError), and the local spec's torch RMSNorm asserts that sequence parallelism is off.
    `transformer_impl` is the resolved one ("local" or "transformer_engine"); plan passes the recipe's.
    """
    if not cuda_available or transformer_impl == "transformer_engine":
        return
    if is_moe:
        raise ValueError(
            "a mixture-of-experts model on CUDA needs Transformer Engine (megatron-core's MoE router calls TE's "
            "GEMM): install it (pip install -e '.[gpu]') and use --transformer-impl transformer_engine or auto."
        )
    if sequence_parallel:
        raise ValueError(
            "--sequence-parallel on CUDA needs Transformer Engine (the local spec's RMSNorm does not support it): "
            "install it (pip install -e '.[gpu]') or drop --sequence-parallel."
        )
