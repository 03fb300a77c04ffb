"""Megatron-Core's optimizer (AdamW, ± distributed optimizer) from an OptimizerConfig."""

from __future__ import annotations

import torch

from megatron_osprey.training.config import OptimizerConfig


def optimizer_config(section: OptimizerConfig, bf16: bool, overlap_param_gather: bool = False):
    """megatron.core OptimizerConfig for AdamW with clipping, fp32 master weights."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=section.lr,
        min_lr=section.min_lr,
        weight_decay=section.weight_decay,
        adam_beta1=section.adam_beta1,
        adam_beta2=section.adam_beta2,
        adam_eps=section.adam_eps,
        clip_grad=section.clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=section.use_distributed_optimizer,
        overlap_param_gather=overlap_param_gather,  # Megatron-Core asks for the DDP config's value
    )


def build_optimizer(model_chunks: list, section: OptimizerConfig, bf16: bool):
    """get_megatron_optimizer over DDP-wrapped model chunks."""
    from megatron.core.optimizer import get_megatron_optimizer

    overlap_param_gather = model_chunks[0].ddp_config.overlap_param_gather
    return get_megatron_optimizer(optimizer_config(section, bf16, overlap_param_gather), model_chunks)


def uses_torch_adam_fallback() -> bool:
    """True when Megatron-Core's distributed optimizer runs on torch.optim.AdamW (no TE / apex)."""
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def sharding_metadata(section: OptimizerConfig) -> dict:
    """The metadata Megatron-LM passes to sharded_state_dict: the distributed optimizer's format.

    `fully_reshardable` (any TP/PP/DP on load) fails on the torch.optim fallback:
    its load copies every state key, including the per-parameter `step` that
    only torch.optim has (distrib_optimizer.py:940, KeyError 'step'). So without
    TE/apex the distributed optimizer uses `dp_reshardable`, as Megatron-LM does
    by default; a TP/PP change then needs --no-load-optim (the model reshards).
    """
    sharding = "dp_reshardable"
    if section.use_distributed_optimizer and section.dist_ckpt_optim_fully_reshardable:
        if uses_torch_adam_fallback():
            raise RuntimeError(
                "--dist-ckpt-optim-fully-reshardable needs Transformer Engine or apex (FusedAdam); "
                "on the torch.optim fallback use the default dp_reshardable format."
            )
        sharding = "fully_reshardable"
    return {
        "distrib_optim_sharding_type": sharding,
        "chained_optim_avoid_prefix": True,
        "singleton_local_shards": False,
    }


def prepare_for_load(optimizer) -> None:
    """A fresh distributed optimizer has no state to load into: create it with one dummy step."""
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    for opt in inner:
        if isinstance(opt, DistributedOptimizer):
            opt._init_optimizer_states_with_dummy_values()


def _saved_steps(state) -> set:
    """Every `step` recorded in param_groups anywhere inside a loaded optimizer state dict."""
    found = set()
    if isinstance(state, dict):
        for key, value in state.items():
            if key == "param_groups" and isinstance(value, list):
                found |= {float(g["step"]) for g in value if isinstance(g, dict) and g.get("step") is not None}
            else:
                found |= _saved_steps(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            found |= _saved_steps(value)
    return found


def restore_adam_steps(optimizer, loaded_state: dict) -> None:
    """Give every parameter its own, correct Adam `step` after a load (torch.optim fallback).

    The distributed optimizer's load on torch.optim puts ONE step tensor into
    every parameter's state (distrib_optimizer.py:819-825), and its dp_reshardable
    path then copies the step of the *pre-load* state over it (:940, `step` is a
    local non-persistent object). Adam's bias correction would restart from the
    dummy step, so a resumed run drifts. The saved step lives in param_groups:
    write it back as one tensor per parameter.
    """
    from megatron.core.optimizer import ChainedOptimizer

    steps = _saved_steps(loaded_state)
    if len(steps) > 1:
        raise ValueError(f"the checkpoint's optimizer param groups disagree on the step count: {sorted(steps)}.")
    inner = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    for opt in inner:
        torch_opt = getattr(opt, "optimizer", None)
        if torch_opt is None:
            continue
        for state in torch_opt.state.values():
            step = state.get("step")
            if not isinstance(step, torch.Tensor):
                continue
            if steps:
                state["step"] = torch.tensor(next(iter(steps)), dtype=step.dtype, device=step.device)
            else:
                state["step"] = step.clone()
