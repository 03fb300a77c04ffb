"""What a stage's job asks of one node (tasks x CPUs, GPUs), against what a node of the recipe's hardware gives."""

from __future__ import annotations

from megatron_osprey.recipes.recipe import NODE_GPUS, Recipe


def node_check(recipe: Recipe, stage: str) -> str:
    """What the stage's job asks of one node, refused (ValueError) where a node of the recipe's hardware has
    fewer GPUs or CPUs (slurm.cpus_per_node)."""
    res, node_cpus, gpu = recipe.stage_resources(stage), recipe.cpus_per_node, recipe.hardware.upper()
    tasks = recipe.tasks_per_node(stage)
    gpus = NODE_GPUS if stage == "regenerate" else res.gpus_per_node
    cpus = tasks * res.cpus_per_task
    where = f"recipe {recipe.run_name} ({stage})"
    if gpus > NODE_GPUS:
        raise ValueError(
            f"{where}: resources.{stage}.gpus_per_node {gpus} is more than the {NODE_GPUS} GPUs of a {gpu} "
            f"node; spread the job over resources.{stage}.nodes."
        )
    if cpus > node_cpus:
        raise ValueError(
            f"{where}: {tasks} task(s) per node x resources.{stage}.cpus_per_task {res.cpus_per_task} = {cpus} "
            f"CPUs, more than the {node_cpus} of a {gpu} node (slurm.cpus_per_node); lower "
            f"resources.{stage}.cpus_per_task, or unset it (the node's CPUs per GPU), or set slurm.cpus_per_node "
            f"to your nodes' count."
        )
    mem = f", --mem {res.mem}" if res.mem else ""
    return (
        f"node: {tasks} task(s) x {res.cpus_per_task} CPUs = {cpus} of {node_cpus} CPUs, "
        f"{gpus} of {NODE_GPUS} GPUs{mem}"
    )
