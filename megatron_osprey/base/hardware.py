"""What this machine can run, asked once in one place."""

from __future__ import annotations


def have_transformer_engine() -> bool:
    """True when Transformer Engine imports (it needs CUDA to run)."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def transformer_engine_usable() -> bool:
    """True when Transformer Engine is installed and CUDA is present."""
    import torch

    return torch.cuda.is_available() and have_transformer_engine()
