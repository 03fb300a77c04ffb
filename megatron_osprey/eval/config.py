"""What an evaluation names (torch-free: recipes and `osprey plan` read it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")
# Where drafters are measured: this project's reference engine alone, or also the real serving engine (vLLM,
# with the reference engine's AL beside it).
EVAL_ENGINES = ("reference", "vllm")


@dataclass
class DrafterSpec:
    """A drafter to evaluate: its name, directory, training domain and method (None: from its run_config)."""

    name: str
    path: Path
    train_domain: str | None = None
    method: str | None = None
