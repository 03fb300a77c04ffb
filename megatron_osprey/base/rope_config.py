"""A HF config.json's RoPE, as ModelArch's rope_theta / rope_scaling / rotary_dim (torch-free).

Scalings: llama3 (Llama-3.x), linear (Gemma 3's global layers) and, for gpt-oss only, YaRN. Partial rotary:
`rotary_dim` (MiniMax-M2) or `partial_rotary_factor` (GLM-4.5, whose HF default is half the head).
"""

from __future__ import annotations

from typing import Any

from megatron_osprey.base.arch_glm_gptoss import YARN_FAMILIES, yarn_scaling
from megatron_osprey.base.config_fields import LLAMA3_ROPE_KEYS


def rope_fields(config: dict[str, Any], model_type: str, head_dim: int, source: str) -> dict[str, Any]:
    """ModelArch's rope_theta, rope_scaling and rotary_dim (0: the whole head) of a config.json."""
    rope = dict(config.get("rope_parameters") or {})
    legacy_scaling = config.get("rope_scaling")
    if legacy_scaling:
        rope.update(legacy_scaling)
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    yarn = model_type in YARN_FAMILIES
    if rope_type not in ("default", "llama3", "linear") and not (yarn and rope_type == "yarn"):
        allowed = "default, llama3, linear, yarn" if yarn else "default, llama3, linear"
        raise ValueError(f"{source}: rope_type {rope_type!r} is not supported ({allowed}).")
    scaling = None
    if rope_type == "yarn":
        scaling = yarn_scaling(rope, int(config.get("max_position_embeddings", 4096)), source)
    if rope_type == "linear":
        if not isinstance(rope.get("factor"), (int, float)) or isinstance(rope.get("factor"), bool):
            raise ValueError(f"{source}: linear RoPE scaling needs a number `factor`, got {rope.get('factor')!r}.")
        scaling = {"rope_type": "linear", "factor": float(rope["factor"])}
    if rope_type == "llama3":
        scaling = {k: rope[k] for k in LLAMA3_ROPE_KEYS}
    rotary_dim = int(config.get("rotary_dim") or 0)
    if model_type == "glm4_moe":  # HF's default for GLM-4.5 is half the head, and it may sit at the top level
        rope.setdefault("partial_rotary_factor", config.get("partial_rotary_factor") or 0.5)
    if not rotary_dim and rope.get("partial_rotary_factor"):
        rotary_dim = int(head_dim * float(rope["partial_rotary_factor"]))
    if rotary_dim in (0, head_dim):
        rotary_dim = 0
    elif rotary_dim > head_dim or rotary_dim % 2:
        raise ValueError(f"{source}: rotary_dim {rotary_dim} must be even and at most head_dim {head_dim}.")
    return dict(rope_theta=theta, rope_scaling=scaling, rotary_dim=rotary_dim)
