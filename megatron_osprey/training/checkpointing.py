"""Megatron dist checkpoints: `iter_NNNNNNN/` + run_config.yaml, the latest pointer written last."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from megatron.core.utils import unwrap_model

from megatron_osprey.base.atomic_io import write_text_atomic
from megatron_osprey.base.checksums import verify_checksums, write_checksums
from megatron_osprey.base.run_config import save_run_config

LATEST_FILE = "latest_checkpointed_iteration.txt"
# Held by the one run that writes a --save directory (base/locks.py; the hidden-state store's writers use it too).
SAVE_LOCK = ".lock-writer"


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def read_latest_iteration(root: str | Path) -> int | None:
    """The iteration the latest pointer names, or None when there is no complete checkpoint."""
    pointer = Path(root) / LATEST_FILE
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{pointer} does not hold an iteration number: {text!r}.")
    return int(text)


# What torch distributed checkpointing's .metadata pickles (measured on this repo's checkpoints):
# its own metadata/planner dataclasses, torch.Size, dtypes and the layout helper. Anything else
# in that file can run code on load, so it is refused before torch unpickles it.
_METADATA_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
)
_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}


class _ForbiddenGlobal(pickle.UnpicklingError):
    """A pickle that names a global no genuine checkpoint metadata holds."""


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals a genuine .metadata needs (the role torch.load's weights_only plays)."""

    def find_class(self, module: str, name: str):
        if module in _METADATA_MODULES:
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        raise _ForbiddenGlobal(f"it references {module}.{name}, which checkpoint metadata never holds")


def check_checkpoint_metadata(path: str | Path) -> None:
    """Read PATH/.metadata with an allow-list unpickler first; refuse a crafted or truncated one.

    torch's FileSystemReader unpickles .metadata with plain pickle (code can run);
    the other files it and Megatron read go through torch.load's weights-only mode.
    """
    meta = Path(path) / ".metadata"
    if not meta.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint: {meta} is missing.")
    try:
        with open(meta, "rb") as handle:
            _MetadataUnpickler(handle).load()
    except _ForbiddenGlobal as exc:
        raise ValueError(f"{meta}: refusing to load this checkpoint: {exc}. Load only checkpoints you trust.") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        raise ValueError(
            f"{meta} is truncated or corrupt ({type(exc).__name__}); use another iteration "
            f"(--ckpt-step) or a fresh copy of the checkpoint."
        ) from None


SKIP_CHECKSUM_HINT = "pass --skip-checksum"


def check_checkpoint_files(path: str | Path, verify: bool = True) -> None:
    """Collective: rank 0 compares PATH's files with the checksums the save recorded; every rank raises its refusal.

    One rank reads the bytes (all ranks share the checkpoint's filesystem); a checkpoint saved before
    checksums were recorded loads unchecked.
    """
    if not verify:
        return
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    message = [None]
    if not distributed or torch.distributed.get_rank() == 0:
        try:
            verify_checksums(path, SKIP_CHECKSUM_HINT)
        except (ValueError, OSError) as exc:
            message = [str(exc)]
    if distributed:
        torch.distributed.broadcast_object_list(message, src=0)
    if message[0] is not None:
        raise ValueError(message[0])


def _dist_load(sharded_state_dict: dict, path: Path) -> dict:
    """dist_checkpointing.load after the metadata check, with one clear sentence for a damaged checkpoint."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    check_checkpoint_metadata(path)
    try:
        return dist_checkpointing.load(sharded_state_dict, str(path))
    except (CheckpointException, RuntimeError, OSError, ValueError, EOFError, pickle.UnpicklingError) as exc:
        # torch gathers every rank's failure into a CheckpointException (a BaseException): name the first.
        cause = next(iter(exc.failures.values()), exc) if isinstance(exc, CheckpointException) else exc
        cause = getattr(cause, "exc", cause)  # torch wraps it with its traceback
        lines = str(cause).strip().splitlines()
        first = lines[0] if lines else ""
        exc = cause if isinstance(cause, BaseException) else exc
        raise ValueError(
            f"{path}: the checkpoint cannot be read ({type(exc).__name__}: {first[:300]}); a file "
            f"in it is truncated or corrupt. Load another iteration (--ckpt-step) or a fresh copy."
        ) from exc


def load_common_state(path: Path) -> dict:
    """PATH's common.pt (weights-only unpickling), a crafted or damaged one refused in one sentence."""
    from megatron.core import dist_checkpointing

    try:
        return dist_checkpointing.load_common_state_dict(str(path))
    except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, OSError, AttributeError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ValueError(
            f"{path / 'common.pt'}: refusing to load this checkpoint ({type(exc).__name__}: {first}); it is "
            f"crafted or corrupt. Load only checkpoints you trust, or another iteration (--ckpt-step)."
        ) from None


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


def check_writable(directory: str | Path, flag: str) -> None:
    """Create `directory` and write a probe file in it, so a read-only --save fails now, not at the first save."""
    import os
    import tempfile

    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=f".write_probe.{os.getpid()}."):
            pass
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"{flag} {directory} is not writable ({exc.strerror or exc}); choose a directory this job can write.",
        ) from None


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


def existing_iteration(root: Path, iteration: int | None, name: str) -> tuple[Path, int]:
    """The directory of the named (or else the latest complete) iteration under `root`, and its number;
    `name` (the flag and path a user gave) opens each error."""
    if iteration is None:
        iteration = read_latest_iteration(root)
        if iteration is None:
            raise FileNotFoundError(f"{name}: no complete checkpoint there ({LATEST_FILE} is missing).")
    path = iteration_dir(root, iteration)
    if not path.is_dir():
        raise FileNotFoundError(f"{name}: checkpoint directory {path} is missing.")
    return path, iteration


def load_checkpoint(
    root: str | Path, sharded_state_dict: dict, iteration: int | None = None, *, verify: bool = True
) -> tuple[dict, int]:
    """Load (resharding as needed) the named or latest iteration, its checksums verified; returns (state, iteration)."""
    root = Path(root)
    path, iteration = existing_iteration(root, iteration, str(root))
    check_checkpoint_files(path, verify)
    return _dist_load(sharded_state_dict, path), iteration


# --- training checkpoints: model + optimizer + scheduler + RNG + data position -------------

CHECKPOINT_FORMAT_VERSION = 1
# Transformer Engine modules' non-tensor state (FP8 amax history / scales) in a state dict.
EXTRA_STATE_SUFFIX = "_extra_state"


def parallel_layout() -> dict[str, int]:
    """This run's TP/PP/DP sizes; RNG states only make sense reloaded into the same layout."""
    from megatron.core import parallel_state as mpu

    return {
        "tensor_model_parallel_size": mpu.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": mpu.get_pipeline_model_parallel_world_size(),
        "data_parallel_size": mpu.get_data_parallel_world_size(),
    }


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch (and CUDA) generators and Megatron's RNG-tracker streams."""
    import random

    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of capture_rng_state."""
    import random

    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(data: Any):
    """One RNG state per (PP, TP, DP) rank: a ShardedObject that no other rank replicates."""
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    layout = parallel_layout()
    shape = (layout["pipeline_model_parallel_size"], layout["tensor_model_parallel_size"], layout["data_parallel_size"])
    offset = (
        mpu.get_pipeline_model_parallel_rank(),
        mpu.get_tensor_model_parallel_rank(),
        mpu.get_data_parallel_rank(),
    )
    return ShardedObject("rng_state", data, shape, offset, replica_id=0)


def _model_sharded_state_dict(model_chunks: list, metadata: dict) -> dict:
    # The bare GPTModel's keys, as Stage 1 writes them: wrappers (DDP, Float16Module) are run-time only.
    if len(model_chunks) == 1:
        return {"model": unwrap_model(model_chunks[0]).sharded_state_dict(metadata=metadata)}
    return {f"model{i}": unwrap_model(c).sharded_state_dict(metadata=metadata) for i, c in enumerate(model_chunks)}


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
    state = _model_sharded_state_dict(model_chunks, metadata)
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
        rng_state=_rng_sharded_object(capture_rng_state()),
    )
    return save_checkpoint(root, iteration, state, run_config)


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

    from megatron_osprey.training.optimizer import prepare_for_load, restore_adam_steps

    root = Path(root)
    path, iteration = existing_iteration(root, iteration, f"--load {root}")
    check_checkpoint_files(path, verify)
    check_checkpoint_metadata(path)
    common = load_common_state(path)
    same_layout = common.get("layout") == parallel_layout()
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
        check_scheduler_unchanged(root, common["opt_param_scheduler"], scheduler, scheduler_flags or SCHEDULER_FLAGS)

    state = _model_sharded_state_dict(model_chunks, metadata)
    model_state = state["model"] if len(model_chunks) == 1 else state
    if load_optim:
        prepare_for_load(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=True, metadata=metadata)
    if load_rng and same_layout:
        state["rng_state"] = _rng_sharded_object(None)
    elif load_rng:
        notes.append("RNG states not restored: the parallel layout changed since the save")
    loaded = _dist_load(state, path)

    if len(model_chunks) == 1:
        unwrap_model(model_chunks[0]).load_state_dict(loaded["model"])
    else:
        for i, chunk in enumerate(model_chunks):
            unwrap_model(chunk).load_state_dict(loaded[f"model{i}"])
    if load_optim:
        # Param groups carry their own max_lr / min_lr, which the optimizer state would bring back.
        fresh = [{k: g[k] for k in ("max_lr", "min_lr") if k in g} for g in optimizer.param_groups]
        optimizer.load_state_dict(loaded["optimizer"])
        restore_adam_steps(optimizer, loaded["optimizer"])
        if scheduler.override_opt_param_scheduler:
            for group, values in zip(optimizer.param_groups, fresh):
                group.update(values)
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if "rng_state" in loaded:
        restore_rng_state(loaded["rng_state"])
    return {
        "iteration": int(loaded["iteration"]),
        "consumed_train_samples": int(loaded["consumed_train_samples"]),
        "notes": notes,
    }


def _same_model_split(saved: dict | None, current: dict) -> bool:
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
    return saved is not None and all(saved.get(k) == current[k] for k in keys)


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


def resume_iteration(checkpoint) -> int | None:
    """The iteration --load resumes from (--ckpt-step, else the latest), or None to start fresh."""
    if not checkpoint.load:
        return None
    if checkpoint.ckpt_step is not None:
        return checkpoint.ckpt_step
    return read_latest_iteration(checkpoint.load)


def load_backbone_weights(megatron_dir: str | Path, model_chunks: list, fresh: tuple[str, ...] = ()) -> int:
    """Initial weights from a Stage 1 checkpoint (model only, resharded to this layout); returns its iteration."""
    iteration = None
    for i, chunk in enumerate(model_chunks):
        # The files once; keys starting with `fresh` keep their init.
        iteration = load_model_weights(megatron_dir, unwrap_model(chunk), verify=i == 0, fresh=fresh)
    return iteration
