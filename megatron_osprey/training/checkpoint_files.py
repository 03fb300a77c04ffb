"""What a checkpoint directory holds and whether to trust it: the `iter_NNNNNNN/` layout and the latest
pointer, the recorded checksums, and reads that refuse crafted or damaged files in one sentence."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from megatron_osprey.base.checksums import verify_checksums

LATEST_FILE = "latest_checkpointed_iteration.txt"


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


def resume_iteration(checkpoint) -> int | None:
    """The iteration --load resumes from (--ckpt-step, else the latest), or None to start fresh."""
    if not checkpoint.load:
        return None
    if checkpoint.ckpt_step is not None:
        return checkpoint.ckpt_step
    return read_latest_iteration(checkpoint.load)


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


def load_sharded(sharded_state_dict: dict, path: Path) -> dict:
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
