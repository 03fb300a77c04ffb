"""Megatron-Core's OptimizerParamScheduler, counted in iterations."""

from __future__ import annotations

from megatron_osprey.training.config import OptimizerConfig


def build_scheduler(optimizer, section: OptimizerConfig, train_iters: int):
    """Linear warmup, then constant / linear / cosine / inverse-sqrt / WSD decay to --min-lr."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_iters = section.decay_iters(train_iters)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=section.lr,
        min_lr=section.min_lr,
        lr_warmup_steps=section.warmup_iters(train_iters),
        lr_decay_steps=decay_iters,
        lr_decay_style=section.lr_decay_style,
        start_wd=section.weight_decay,
        end_wd=section.weight_decay,
        wd_incr_steps=decay_iters,
        wd_incr_style="constant",
        # A resume refuses changed schedule flags (checkpointing.check_scheduler_unchanged), so the
        # checkpoint's values equal these unless --override-opt-param-scheduler asks for the new ones.
        use_checkpoint_opt_param_scheduler=not section.override_opt_param_scheduler,
        override_opt_param_scheduler=section.override_opt_param_scheduler,
        wsd_decay_steps=section.lr_wsd_decay_iters,
        lr_wsd_decay_style=section.lr_wsd_decay_style,
    )


def current_lr(optimizer) -> float:
    """The learning rate of the first parameter group (all groups share the schedule)."""
    for group in optimizer.param_groups:
        return float(group["lr"])
    return 0.0
