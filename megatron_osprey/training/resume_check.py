"""What a training checkpoint was trained on, so a resume onto other data or another run is refused.

A checkpoint records its run identity: flag -> {"value": what is compared, "shown": what a message
prints}. The data is identified by content (an indexed file's .idx sha256 and .bin size, a JSONL's
sha256, a store's manifest sha256), so a moved copy of the same data still resumes. On resume each
setting is compared and a difference refused naming the flag and both values, with three kinds:

- RUN settings (data, mode, model, sequence length, global batch, seed, loss): always refused; the
  resumed steps would silently train another run than the one the checkpoint and its record describe.
- OPTIMIZER settings (clipping, Adam's betas and eps): accepted with --override-opt-param-scheduler,
  like the schedule, and noted.
- LAYOUT settings (micro-batch, parallel sizes): the checkpoint reshards and the global batch keeps
  the data order, so a change is noted, not refused.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from megatron_osprey.base.checksums import file_sha256

OPTIMIZER_SETTINGS = ("--clip-grad", "--adam-beta1", "--adam-beta2", "--adam-eps")
LAYOUT_SETTINGS = (
    "--micro-batch-size",
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--virtual-pipeline-model-parallel-size",
    "--expert-model-parallel-size",
    "--data-parallel-size",
)


def setting(value: Any, shown: str | None = None) -> dict[str, str]:
    """One recorded setting: its value as canonical JSON, and how a message shows it (with a content digest)."""
    text = json.dumps(value, sort_keys=True, default=str)
    if shown is not None:
        shown = f"{shown} (content {hashlib.sha256(text.encode()).hexdigest()[:12]})"
    return {"value": text, "shown": shown if shown is not None else text}


def indexed_data_setting(data_path: list[str], prefixes: list[str]) -> dict[str, str]:
    """--data-path of Megatron indexed data: the blend as given, each prefix by .idx sha256 and .bin size."""
    content = [{"idx_sha256": file_sha256(f"{p}.idx"), "bin_bytes": Path(f"{p}.bin").stat().st_size} for p in prefixes]
    weights = [w for w in data_path if w not in prefixes]
    return setting({"weights": weights, "files": content}, " ".join(data_path))


def files_setting(paths: list[str]) -> dict[str, str]:
    """Data files (conversations JSONL) by sha256."""
    return setting([file_sha256(p) for p in paths], " ".join(paths))


def store_setting(store: str) -> dict[str, str]:
    """A hidden-state store by its manifest (which lists every shard's sha256 and the target's config hash)."""
    return setting(file_sha256(Path(store) / "manifest.json"), store)


def compare_run_identity(
    root: str | Path, saved: dict[str, dict] | None, current: dict[str, dict], override_optimizer: bool
) -> list[str]:
    """Refuse a resume whose run differs from the checkpoint's (module docstring); returns notes to log."""
    if saved is None:
        return [f"--load {root}: the checkpoint records no run settings (saved by an older version); not compared"]
    notes = []
    for flag in sorted(set(saved) | set(current)):
        before, now = saved.get(flag), current.get(flag)
        if (before or {}).get("value") == (now or {}).get("value"):
            continue
        was = before["shown"] if before else "(not recorded)"
        is_now = now["shown"] if now else "(not set)"
        change = f"{flag}: the checkpoint has {was}, this run {is_now}"
        if flag in LAYOUT_SETTINGS:
            notes.append(f"resuming with another layout ({change})")
        elif flag in OPTIMIZER_SETTINGS and override_optimizer:
            notes.append(f"--override-opt-param-scheduler: {change}")
        else:
            accept = (
                " or pass --override-opt-param-scheduler to accept the change" if flag in OPTIMIZER_SETTINGS else ""
            )
            raise ValueError(
                f"--load {root}: {change}; a resume must continue the same run. Rerun with the checkpoint's "
                f"value{accept}, or start a fresh run with another --save (no --load)."
            )
    return notes


def training_settings(cfg, dp_size: int) -> dict[str, dict]:
    """The settings every training stage shares: batch geometry, seed, clipping and Adam, the layout."""
    training, optimizer, parallel = cfg.training, cfg.optimizer, cfg.parallel
    return {
        "--seq-length": setting(training.seq_length),
        "--global-batch-size": setting(training.global_batch_size),
        "--seed": setting(parallel.seed),
        "--clip-grad": setting(optimizer.clip_grad),
        "--adam-beta1": setting(optimizer.adam_beta1),
        "--adam-beta2": setting(optimizer.adam_beta2),
        "--adam-eps": setting(optimizer.adam_eps),
        "--micro-batch-size": setting(training.micro_batch_size),
        "--tensor-model-parallel-size": setting(parallel.tensor_model_parallel_size),
        "--pipeline-model-parallel-size": setting(parallel.pipeline_model_parallel_size),
        "--virtual-pipeline-model-parallel-size": setting(parallel.virtual_pipeline_model_parallel_size),
        "--expert-model-parallel-size": setting(parallel.expert_model_parallel_size),
        "--data-parallel-size": setting(dp_size),
    }


def built_on_rank0(build: Callable[[], dict[str, dict]]) -> dict[str, dict]:
    """Collective: rank 0 builds the identity (reading the data once per job) and every rank gets a copy."""
    import torch

    identity = [build() if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(identity, src=0)
    return identity[0]
