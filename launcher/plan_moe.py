"""`osprey plan` for a mixture-of-experts target that does not fit its recipe's node: how many nodes it needs.

The experts are what grows with the model (DeepSeek-V3's 671B, Kimi-K2's 1T parameters in BF16), and expert
parallelism across nodes is what spreads them: the least number of nodes (a power of two) at which the plan's other
terms plus the target's weights at expert parallel size nodes x GPUs per node fit one GPU, with the overrides that
ask for it.
"""

from __future__ import annotations

import dataclasses

from megatron_osprey.base.memory import GIB, estimate_target_memory, parallel_sizes
from megatron_osprey.recipes.recipe import GPU_MEMORY_GIB

MAX_NODES = 64


def moe_nodes_needed(recipe, stage: str, target, parallel, memory, gpus_per_node: int) -> str | None:
    """None where the plan fits or the target is dense; else the nodes its experts need and the `--set` lines."""
    gib = GPU_MEMORY_GIB.get(recipe.hardware)
    if target is None or not target.is_moe or not gib or sum(b for _, b in memory) <= gib * GIB:
        return None
    others = sum(b for name, b in memory if name != "target weights")  # no other term changes with EP
    size = f"its {target.num_parameters() / 1e9:.0f}B-parameter target"
    nodes = 2
    while nodes <= MAX_NODES and target.num_experts % (nodes * gpus_per_node) == 0:
        ep = nodes * gpus_per_node
        wider = dataclasses.replace(parallel, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
        weights = estimate_target_memory(target, **parallel_sizes(wider))  # its weights: no batch dependence
        if others + weights.weight_bytes <= gib * GIB:
            return (
                f"{size} fits {nodes} nodes of {gpus_per_node} x {recipe.hardware.upper()} at expert parallel size "
                f"{ep} (about {(others + weights.weight_bytes) / GIB:.1f} GiB per GPU): --set "
                f"resources.{stage}.nodes={nodes} --set {stage}.parallel.expert_model_parallel_size={ep}"
            )
        nodes *= 2
    return f"{size} does not fit at any expert parallel size up to {MAX_NODES} nodes of this layout"
