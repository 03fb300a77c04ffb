"""Megatron dist checkpoints: `iter_NNNNNNN/` + run_config.yaml, the latest pointer written last.

Saving and loading: any sharded state (the stages' model-only checkpoints), a training run's whole
state (model + optimizer + scheduler + RNG + data position) for a bit-exact resume, and a model's
weights from either. The files and their checks are checkpoint_files.py's; the training state's
pieces checkpoint_state.py's.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from megatron.core.utils import unwrap_model

from megatron_osprey.base.atomic_io import write_text_atomic
from megatron_osprey.base.checksums import write_checksums
from megatron_osprey.base.run_config import save_run_config
from megatron_osprey.training.checkpoint_files import (
    LATEST_FILE,
    check_checkpoint_files,
    check_checkpoint_metadata,
    existing_iteration,
    iteration_dir,
    load_common_state,
    load_sharded,
    read_latest_iteration,  # noqa: F401  (eval and tests import it from here)
    resume_iteration,  # noqa: F401  (the assembly and tests import it from here)
)
from megatron_osprey.training.checkpoint_state import (
    CHECKPOINT_FORMAT_VERSION,
    capture_rng_state,
    load_model_state,
    model_sharded_state_dict,
    parallel_layout,
    restore_rng_state,
    rng_sharded_object,
)

# Held by the one run that writes a --save directory (base/locks.py; the hidden-state store's writers use it too).
SAVE_LOCK = ".lock-writer"
# Transformer Engine modules' non-tensor state (FP8 amax history / scales) in a state dict.
EXTRA_STATE_SUFFIX = "_extra_state"


def acquire_save_lock(root: str | Path):
    """Collective: rank 0 takes --save's writer lock; every rank raises the same refusal when a live run holds it.

    Returns rank 0's WriterLock (None on other ranks); its `stale` names a dead holder it took over.
    """
    from megatron_osprey.base.locks import LockHeldError, acquire_writer_lock

    lock, message = None, [None]
    if torch.distributed.get_rank() == 0:
        try:
            lock = acquire_writer_lock(Path(root) / SAVE_LOCK, f"--save {root}")
        except LockHeldError as exc:
            message = [str(exc)]
    torch.distributed.broadcast_object_list(message, src=0)
    if message[0] is not None:
        raise LockHeldError(message[0])
    return lock


def _explain_failed_save(exc: BaseException, root: Path, iteration: int) -> BaseException:
    """A failed save on a full disk surfaces as torch's "unexpected pos N vs M": say that the disk is full."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    cause = next(iter(exc.failures.values()), exc) if isinstance(exc, CheckpointException) else exc
    cause = getattr(cause, "exc", cause)
    free = shutil.disk_usage(root).free
    full = (
        getattr(cause, "errno", None) == errno.ENOSPC
        or "unexpected pos" in str(cause)
        or "No space left" in str(cause)
        or free < (16 << 20)
    )
    if not full:
        return exc
    return OSError(
        errno.ENOSPC,
        f"saving iteration {iteration} to {root} failed: the disk is full "
        f"({free / 2**20:.1f} MiB free). The previous checkpoint and the latest pointer are "
        f"untouched; free space, then resume with --load {root}.",
    )


def require_psutil() -> None:
    """megatron-core's checkpoint writer calls psutil inside its forked writer processes: without it each
    writer dies before it reports, and the save waits for them forever instead of failing."""
    import importlib.util

    if importlib.util.find_spec("psutil") is None:
        raise ModuleNotFoundError(
            "saving a checkpoint needs psutil (megatron-core's checkpoint writer processes use it, and without "
            "it the save hangs): install psutil==7.2.2."
        )


def save_checkpoint(
    root: str | Path,
    iteration: int,
    sharded_state_dict: dict,
    run_config: dict[str, Any],
) -> Path:
    """Save collectively into a temp dir, rename it into place, then move the latest pointer."""
    from megatron.core import dist_checkpointing

    require_psutil()

    root = Path(root)
    final = iteration_dir(root, iteration)
    staging = root / f".tmp_{final.name}"
    rank = torch.distributed.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)  # left by a save that was killed midway
        staging.mkdir()
    torch.distributed.barrier()
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dist_checkpointing.save(sharded_state_dict, str(staging))
    except (CheckpointException, RuntimeError, OSError) as exc:
        explained = _explain_failed_save(exc, root, iteration)
        if explained is exc:
            raise
        raise explained from None
    torch.distributed.barrier()
    if rank == 0:
        save_run_config(staging / "run_config.yaml", run_config)
        write_checksums(staging)  # before the rename and the latest pointer: a listed iteration is checksummed
        # Re-saving an iteration: move the old copy aside first so a kill leaves one of them whole.
        stale = root / f".old_{final.name}"
        if final.exists():
            if stale.exists():
                shutil.rmtree(stale)
            final.rename(stale)
        staging.rename(final)
        if stale.exists():
            shutil.rmtree(stale)
        write_text_atomic(root / LATEST_FILE, f"{iteration}\n")
    torch.distributed.barrier()
    return final


def save_training_checkpoint(
    root: str | Path,
    iteration: int,
    consumed_train_samples: int,
    model_chunks: list,
    optimizer,
    scheduler,
    run_config: dict[str, Any],
    metadata: dict,
    run_identity: dict[str, dict] | None = None,
) -> Path:
    """Collectively save everything a bit-exact resume needs (finite weights only); the latest pointer moves last.

    `run_identity` (training/resume_check.py) is what a resume compares: the data and the run's settings.
    """
    check_finite_weights(model_chunks, iteration)
    state = model_sharded_state_dict(model_chunks, metadata)
    model_state = state["model"] if len(model_chunks) == 1 else state
    state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=False, metadata=metadata)
    state.update(
        opt_param_scheduler=scheduler.state_dict(),
        iteration=iteration,
        consumed_train_samples=consumed_train_samples,
        layout=parallel_layout(),
        optimizer_format={
            "distributed": metadata.get("use_distributed_optimizer", False),
            "sharding": metadata["distrib_optim_sharding_type"],
        },
        checkpoint_version=CHECKPOINT_FORMAT_VERSION,
        run_identity=run_identity or {},
        rng_state=rng_sharded_object(capture_rng_state()),
    )
    return save_checkpoint(root, iteration, state, run_config)


def check_finite_weights(model_chunks: list, iteration: int) -> None:
    """Collective: refuse to save weights holding NaN or inf (a diverged run must not leave them as its result)."""
    bad = [
        name for chunk in model_chunks for name, p in unwrap_model(chunk).named_parameters() if not p.isfinite().all()
    ]
    flag = torch.tensor([float(len(bad))], device=next(model_chunks[0].parameters()).device)
    torch.distributed.all_reduce(flag)
    if flag.item():
        where = f" ({bad[0]}{' and others' if len(bad) > 1 else ''})" if bad else " (on another rank)"
        raise FloatingPointError(
            f"the weights hold NaN or inf at iteration {iteration}{where}; not saving them. The run diverged: "
            f"resume from the last checkpoint with a lower --lr, or keep --max-nonfinite-loss-steps at 1."
        )


def load_checkpoint(
    root: str | Path, sharded_state_dict: dict, iteration: int | None = None, *, verify: bool = True
) -> tuple[dict, int]:
    """Load (resharding as needed) the named or latest iteration, its checksums verified; returns (state, iteration)."""
    root = Path(root)
    path, iteration = existing_iteration(root, iteration, str(root))
    check_checkpoint_files(path, verify)
    return load_sharded(sharded_state_dict, path), iteration


def load_model_weights(
    root: str | Path, module, iteration: int | None = None, *, verify: bool = True, fresh: tuple[str, ...] = ()
) -> int:
    """A model's weights from any of our checkpoints (Stage 1/3 or training), resharded to this layout.

    Training checkpoints also hold the optimizer, scheduler and counters as common
    state; only the model's own keys are taken. Transformer Engine modules add
    `_extra_state` entries (their FP8 scaling state) that a checkpoint written with the
    local spec (Stage 1 and 3 on a CPU) does not have: those start fresh, as do keys starting with `fresh`
    (modules an option adds that the checkpoint was written without).
    """
    wanted = module.sharded_state_dict()
    weights = {
        key: value
        for key, value in wanted.items()
        if not key.endswith(EXTRA_STATE_SUFFIX) and not key.startswith(fresh)
    }
    loaded, iteration = load_checkpoint(root, weights, iteration, verify=verify)
    missing, unexpected = module.load_state_dict({key: loaded[key] for key in weights}, strict=False)
    missing = [key for key in missing if not key.endswith(EXTRA_STATE_SUFFIX) and not key.startswith(fresh)]
    if missing or unexpected:
        raise ValueError(f"checkpoint {root}: missing keys {missing}, unexpected keys {unexpected}.")
    return iteration


def load_backbone_weights(
    megatron_dir: str | Path, model_chunks: list, fresh: tuple[str, ...] = (), *, verify: bool = True
) -> int:
    """Initial weights from a Stage 1 checkpoint (model only, resharded to this layout); returns its iteration."""
    iteration = None
    for i, chunk in enumerate(model_chunks):
        # The files once; keys starting with `fresh` keep their init.
        iteration = load_model_weights(megatron_dir, unwrap_model(chunk), verify=verify and i == 0, fresh=fresh)
    return iteration


# The scheduler's state -> the flag that sets it (callers rename the decay / warmup length's source).
SCHEDULER_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "--lr-warmup-iters",
    "lr_decay_steps": "--lr-decay-iters",
    "lr_decay_style": "--lr-decay-style",
    "start_wd": "--weight-decay",
}


def scheduler_flags(decay_iters_flag: str | None, length_flag: str, warmup_flag: str = "--lr-warmup-iters") -> dict:
    """SCHEDULER_FLAGS naming what really sets the decay length: --lr-decay-iters, or the run's length."""
    return SCHEDULER_FLAGS | {
        "lr_decay_steps": decay_iters_flag or f"{length_flag} (the decay length)",
        "lr_warmup_steps": warmup_flag,
    }


def check_scheduler_unchanged(root: str | Path, saved: dict, scheduler, flags: dict[str, str]) -> None:
    """Refuse a resume whose schedule flags differ from the checkpoint's, unless the scheduler overrides.

    Megatron's scheduler silently keeps the checkpoint's values
    (use_checkpoint_opt_param_scheduler), while the printed and saved config
    would show the new ones: the record would be false.
    """
    if scheduler.override_opt_param_scheduler:
        return
    current = scheduler.state_dict()
    for key, flag in flags.items():
        if key in saved and key in current and saved[key] != current[key]:
            raise ValueError(
                f"--load {root}: {flag} gives {key} = {current[key]} but the checkpoint's schedule has "
                f"{saved[key]}; rerun with the checkpoint's value, or pass --override-opt-param-scheduler to "
                f"switch to the new schedule from iteration {saved.get('num_steps')}."
            )


@torch.no_grad()  # fp32 main params of the distributed optimizer are views of leaf parameters
def load_training_checkpoint(
    root: str | Path,
    model_chunks: list,
    optimizer,
    scheduler,
    metadata: dict,
    *,
    iteration: int | None = None,
    load_optim: bool = True,
    load_rng: bool = True,
    scheduler_flags: dict[str, str] | None = None,
    verify: bool = True,
    run_identity: dict[str, dict] | None = None,
) -> dict[str, Any]:
    """Load (resharding the model across TP/PP/DP as needed); returns iteration, consumed samples and notes.

    With `run_identity`, a checkpoint of another run (other data, batch, length...) is refused first.
    """

    from megatron_osprey.training.optimizer import prepare_for_load

    root = Path(root)
    path, iteration = existing_iteration(root, iteration, f"--load {root}")
    check_checkpoint_files(path, verify)
    check_checkpoint_metadata(path)
    common = load_common_state(path)
    same_layout = common.get("layout") == parallel_layout()
    notes = _check_resumable(root, common, scheduler, metadata, load_optim, scheduler_flags, run_identity)

    state = model_sharded_state_dict(model_chunks, metadata)
    model_state = state["model"] if len(model_chunks) == 1 else state
    if load_optim:
        prepare_for_load(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=True, metadata=metadata)
    if load_rng and same_layout:
        state["rng_state"] = rng_sharded_object(None)
    elif load_rng:
        notes.append("RNG states not restored: the parallel layout changed since the save")
    loaded = load_sharded(state, path)

    load_model_state(model_chunks, loaded)
    if load_optim:
        _restore_optimizer_and_scheduler(loaded, optimizer, scheduler)
    if "rng_state" in loaded:
        restore_rng_state(loaded["rng_state"])
    return {
        "iteration": int(loaded["iteration"]),
        "consumed_train_samples": int(loaded["consumed_train_samples"]),
        "notes": notes,
    }


def _check_resumable(
    root: Path,
    common: dict,
    scheduler,
    metadata: dict,
    load_optim: bool,
    flags: dict[str, str] | None,
    run_identity: dict[str, dict] | None,
) -> list[str]:
    """Refuse a checkpoint of another run, an optimizer state this run cannot take, or changed schedule flags,
    before any sharded file is read; returns the notes of accepted differences."""
    notes = []
    if run_identity is not None:
        from megatron_osprey.training.resume_check import compare_run_identity

        saved_identity = common.get("run_identity") or None
        notes += compare_run_identity(root, saved_identity, run_identity, scheduler.override_opt_param_scheduler)
    distributed = metadata.get("use_distributed_optimizer", False)
    saved = common.get("optimizer_format", {})
    if load_optim and saved.get("distributed", False) != distributed:
        raise ValueError(
            f"--load {root}: its optimizer state was saved {'with' if saved.get('distributed') else 'without'} "
            f"--use-distributed-optimizer; match it, or pass --no-load-optim."
        )
    if (
        load_optim
        and distributed
        and saved.get("sharding") == "dp_reshardable"
        and not _same_model_split(common.get("layout"), parallel_layout())
    ):
        raise ValueError(
            f"--load {root}: its distributed-optimizer state (dp_reshardable) cannot move to a different "
            f"TP/PP layout; pass --no-load-optim (the model weights still reshard)."
        )

    if load_optim and "opt_param_scheduler" in common:
        check_scheduler_unchanged(root, common["opt_param_scheduler"], scheduler, flags or SCHEDULER_FLAGS)
    return notes


def _restore_optimizer_and_scheduler(loaded: dict, optimizer, scheduler) -> None:
    """The loaded optimizer and scheduler states; under --override-opt-param-scheduler the groups keep this
    run's max_lr / min_lr (param groups carry their own, which the optimizer state would bring back)."""
    from megatron_osprey.training.optimizer import restore_adam_steps

    fresh = [{k: g[k] for k in ("max_lr", "min_lr") if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(loaded["optimizer"])
    restore_adam_steps(optimizer, loaded["optimizer"])
    if scheduler.override_opt_param_scheduler:
        for group, values in zip(optimizer.param_groups, fresh):
            group.update(values)
    scheduler.load_state_dict(loaded["opt_param_scheduler"])


def _same_model_split(saved: dict | None, current: dict) -> bool:
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
    return saved is not None and all(saved.get(k) == current[k] for k in keys)
