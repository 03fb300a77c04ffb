"""What a checkpoint directory holds and whether to trust it: the `iter_NNNNNNN/` layout and the latest
pointer, the recorded checksums, and reads that refuse crafted or damaged files in one sentence."""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
from torch.distributed.checkpoint._traverse import set_element

from megatron_osprey.base.checksums import CHECKSUMS_FILE, verify_checksums

LATEST_FILE = "latest_checkpointed_iteration.txt"
ITERATION_NAME = re.compile(r"iter_\d{7}")


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def read_latest_iteration(root: str | Path) -> int | None:
    """The iteration the latest pointer names, or None when there is no checkpoint; a directory that holds
    iterations without its pointer is refused (a resume from init would overwrite them)."""
    pointer = Path(root) / LATEST_FILE
    if not pointer.is_file():
        saved = sorted(p.name for p in Path(root).glob("iter_*") if ITERATION_NAME.fullmatch(p.name) and p.is_dir())
        if saved:
            raise FileNotFoundError(
                f"{pointer} is missing but {Path(root)} holds {len(saved)} iterations (the last {saved[-1]}): "
                f"restore the pointer (a file holding the iteration number, e.g. {int(saved[-1][5:])}) or name "
                f"one with --ckpt-step."
            )
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


# The byte entries of a .distcp file (a ShardedObject each: the RNG state, Transformer Engine's _extra_state)
# are torch.save pickles that torch's DefaultLoadPlanner.load_bytes decodes with weights_only=False: a crafted
# entry would run code on resume. They are decoded weights-only here (tensors and plain containers), plus the
# NumPy array globals of an RNG state saved before capture_rng_state stored NumPy's keys as a tensor (an array's
# reconstruction runs no code of the file's choosing). Transformer Engine 2.x keeps its _extra_state as a tensor.
_UNSAFE_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def _legacy_numpy_globals() -> list:
    import numpy as np

    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray  # NumPy 2 / 1
    return [np.dtype, np.ndarray, multiarray._reconstruct, type(np.dtype(np.uint32))]


def decode_byte_entry(value: io.BytesIO, key: str):
    """One byte entry of a .distcp, decoded weights-only; a pickle naming anything else is refused by its key."""
    try:
        with torch.serialization.safe_globals(_legacy_numpy_globals()):
            return torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = _UNSAFE_GLOBAL.search(str(exc))
        what = f"references {found.group(1)}" if found else f"is not plain data ({str(exc).splitlines()[0][:120]})"
        raise _ForbiddenGlobal(f"its entry {key!r} {what}, which a checkpoint's byte entries never hold") from None


class PlainDataLoadPlanner(mcore_torch.MCoreLoadPlanner):
    """MCoreLoadPlanner whose byte entries go through decode_byte_entry."""

    # DefaultLoadPlanner.load_bytes (torch 2.13) with the decoding replaced.
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        decoded = decode_byte_entry(value, fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], decoded)
        else:
            self.state_dict[fqn] = decoded


class PlainDataLoadStrategy(mcore_torch.TorchDistLoadShardedStrategy):
    """megatron-core's torch_dist load strategy with PlainDataLoadPlanner (every dist checkpoint load uses it)."""

    # TorchDistLoadShardedStrategy.load builds its planner inline, under its module's name MCoreLoadPlanner, in every
    # megatron-core of the supported range, with arguments that change between releases (0.17 added
    # stream_ckpt_dequant and flatten flags). So the method is not copied: for the length of this one load that name
    # stands for PlainDataLoadPlanner, a subclass taking the same arguments (a test checks the method still uses it).
    def load(self, sharded_state_dict, checkpoint_dir, *args, **kwargs):
        original = mcore_torch.MCoreLoadPlanner
        mcore_torch.MCoreLoadPlanner = PlainDataLoadPlanner
        try:
            return super().load(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        finally:
            mcore_torch.MCoreLoadPlanner = original


SKIP_CHECKSUM_HINT = "pass --skip-checksum"


def check_checkpoint_files(path: str | Path, verify: bool = True) -> None:
    """Collective: rank 0 compares PATH's files with the checksums the save recorded; every rank raises its refusal.

    One rank reads the bytes (all ranks share the checkpoint's filesystem); a checkpoint without its
    checksums.json is refused like a damaged one.
    """
    if not verify:
        return
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    message = [None]
    if not distributed or torch.distributed.get_rank() == 0:
        try:
            if not verify_checksums(path, SKIP_CHECKSUM_HINT):
                message = [
                    f"{Path(path) / CHECKSUMS_FILE} is missing: every save records it, so these files cannot be "
                    f"checked; {SKIP_CHECKSUM_HINT} to load them unverified (only a copy you trust)."
                ]
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
        return dist_checkpointing.load(sharded_state_dict, str(path), sharded_strategy=PlainDataLoadStrategy())
    except (CheckpointException, RuntimeError, OSError, ValueError, EOFError, pickle.UnpicklingError) as exc:
        # torch gathers every rank's failure into a CheckpointException (a BaseException), each step's failures
        # in another, each failure with its traceback: name the first.
        cause = exc
        while isinstance(cause, CheckpointException) and cause.failures:
            cause = next(iter(cause.failures.values()))
            cause = getattr(cause, "exc", cause)
            cause = cause[0] if isinstance(cause, tuple) and cause and isinstance(cause[0], BaseException) else cause
        if isinstance(cause, _ForbiddenGlobal):
            raise ValueError(
                f"{path}: refusing to load this checkpoint: {cause}. Load only checkpoints you trust."
            ) from None
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
