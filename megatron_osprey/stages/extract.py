"""Extract a target's hidden states (aux layers + final pre-norm) for offline distillation.

    torchrun --nproc_per_node=8 -m megatron_osprey extract --target /models/MiniMax-M2.5 \\
        --data conversations.jsonl --output /store/minimax --expert-model-parallel-size 8 \\
        --tensor-model-parallel-size 1 --gpu-memory-gib 139

Slurm array jobs: each task takes slice SLURM_ARRAY_TASK_ID of SLURM_ARRAY_TASK_COUNT (or --shard i/n);
the last task to finish merges the manifest. Reruns resume. The loop is data/extract.py.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from megatron_osprey.config.flags import STORE_TRUE, Flag, boolean, under
from megatron_osprey.data.hidden_state_store.config import ENCODINGS, HiddenStateStoreConfig
from megatron_osprey.models.backbone.config import TRANSFORMER_IMPLS
from megatron_osprey.models.target.config import TARGET_FLAGS, TargetConfig
from megatron_osprey.parallel.config import (
    EXPERT_PARALLEL_FLAGS,
    LOADING_TIMEOUT_FLAG,
    PARALLEL_FLAGS,
    ParallelConfig,
)
from megatron_osprey.stages.cli import Invocation, check_inputs, exit_code, in_process_groups, is_rank0, parse_config

PARAMS_DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclasses.dataclass
class ExtractConfig:
    """What to extract, from which target, into which store, and which slice of the data."""

    target: TargetConfig = dataclasses.field(default_factory=TargetConfig)
    data_path: str | None = None  # conversations JSONL
    store: HiddenStateStoreConfig = dataclasses.field(default_factory=HiddenStateStoreConfig)
    aux_layer_ids: list[int] | None = None  # None: [1, L//2 - 1, L - 4]
    max_length: int = 4096
    micro_batch_size: int = 1
    shard: str | None = None  # "i/n"; None: the Slurm array task, else 0/1
    params_dtype: str = "auto"  # bfloat16 on GPU, float32 on CPU
    transformer_impl: str = "auto"
    enable_thinking: bool | None = None
    gpu_memory_gib: float | None = None  # None: the device's memory
    finalize: bool = True  # merge the manifest parts once every writer is complete
    overwrite: bool = False  # a store made from other inputs or settings is deleted instead of refused
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)

    def validate(self) -> None:
        """Raise one clear error on a bad field."""
        if not self.target.path or not Path(self.target.path).is_dir():
            raise FileNotFoundError(f"--target {self.target.path!r} is not a directory (a HF checkpoint).")
        if not self.data_path or not Path(self.data_path).is_file():
            raise FileNotFoundError(f"--data {self.data_path!r} is not a file (conversations JSONL).")
        if not self.store.store_dir:
            raise ValueError("--output must name the hidden-state store directory.")
        if self.store.encoding not in ENCODINGS:
            raise ValueError(f"--encoding must be one of {ENCODINGS}, got {self.store.encoding!r}.")
        if self.micro_batch_size < 1 or self.max_length < 1:
            raise ValueError("--micro-batch-size and --max-length must be >= 1.")

    def shard_slice(self, environ) -> tuple[int, int]:
        """(index, count) from --shard i/n, else SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT, else (0, 1)."""
        if self.shard:
            try:
                index, count = (int(x) for x in self.shard.split("/"))
            except ValueError:
                raise ValueError(f"--shard must look like i/n (e.g. 3/16), got {self.shard!r}.") from None
        elif "SLURM_ARRAY_TASK_ID" in environ:
            count = int(environ.get("SLURM_ARRAY_TASK_COUNT", "0"))
            if count < 1:
                raise ValueError("SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_COUNT is not; pass --shard i/n.")
            # Arrays may start at a non-zero id (--array=1-16): count from SLURM_ARRAY_TASK_MIN.
            index = int(environ["SLURM_ARRAY_TASK_ID"]) - int(environ.get("SLURM_ARRAY_TASK_MIN", "0"))
        else:
            index, count = 0, 1
        if not 0 <= index < count:
            raise ValueError(f"--shard {index}/{count}: the index must be in [0, {count}).")
        return index, count


_LAYOUT = (
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--expert-model-parallel-size",
    "--expert-tensor-parallel-size",
    "--sequence-parallel",
    "--distributed-timeout-minutes",
    "--seed",
)
FLAGS = {
    "extract": [
        *under("target", TARGET_FLAGS),
        Flag("--data", "data_path", {"help": "conversations JSONL"}),
        Flag("--output", "store.store_dir", {"help": "hidden-state store directory"}),
        Flag(
            "--aux-layer-ids",
            "aux_layer_ids",
            {"type": int, "nargs": "+", "help": "0-based target layers stored (default 1, L//2-1, L-4)"},
        ),
        Flag("--shard", "shard", {"help": "i/n: take slice i of n (default: the Slurm array task, else 0/1)"}),
        Flag("--encoding", "store.encoding", {"choices": list(ENCODINGS)}),
        Flag("--samples-per-shard", "store.samples_per_shard", {"type": int}),
        Flag("--max-length", "max_length", {"type": int}),
        Flag("--micro-batch-size", "micro_batch_size", {"type": int}),
        Flag("--params-dtype", "params_dtype", {"choices": list(PARAMS_DTYPES)}),
        Flag("--transformer-impl", "transformer_impl", {"choices": list(TRANSFORMER_IMPLS)}),
        Flag(
            "--gpu-memory-gib",
            "gpu_memory_gib",
            {"type": float, "help": "refuse layouts whose per-GPU estimate exceeds this (default: the device's)"},
        ),
        Flag("--enable-thinking", "enable_thinking", {"type": boolean, "metavar": "true|false"}),
        Flag(
            "--overwrite",
            "overwrite",
            {**STORE_TRUE, "help": "delete a store made from other data, another target or other settings"},
        ),
    ],
    "distributed": under(
        "parallel", [*(f for f in PARALLEL_FLAGS + EXPERT_PARALLEL_FLAGS if f.flag in _LAYOUT), LOADING_TIMEOUT_FLAG]
    ),
}


def device_memory_gib() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30


def preflight_memory(config: ExtractConfig, arch, say=print) -> None:
    """Print the per-GPU estimate; refuse (TargetMemoryError) when it exceeds the GPU's memory."""
    from megatron_osprey.base.arch import resolve_aux_layer_ids
    from megatron_osprey.base.memory import check_fits, estimate_target_memory, parallel_sizes

    p = config.parallel
    arch.validate_parallel(
        p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size, p.sequence_parallel
    )
    aux = resolve_aux_layer_ids(config.aux_layer_ids, arch.num_layers)
    estimate = estimate_target_memory(
        arch,
        **parallel_sizes(p),
        micro_batch_size=config.micro_batch_size,
        seq_length=config.max_length,
        num_captured_layers=len(aux) + 1,
    )
    say(estimate.summary())
    budget = config.gpu_memory_gib if config.gpu_memory_gib is not None else device_memory_gib()
    if budget is not None:
        check_fits(estimate, budget)


def run(config: ExtractConfig, invocation: Invocation = Invocation("extract")):
    """Check the config and the memory before any process group exists, then extract this rank's slice."""
    from megatron_osprey.base.arch import ModelArch
    from megatron_osprey.data.extract import extract_hidden_states

    config.validate()
    shard = config.shard_slice(os.environ)
    arch = ModelArch.from_hf_config(config.target.path)  # the one parse of its config.json, passed down
    rank0 = is_rank0()
    preflight_memory(config, arch, print if rank0 else (lambda _: None))
    inputs = check_inputs({"conversations": config.data_path}) if rank0 else {}
    result = in_process_groups(config.parallel, lambda state: extract_hidden_states(config, state, arch, shard=shard))
    if rank0 and result.manifest is not None:  # the store is whole: the last array task records it
        invocation.record(config.store.store_dir, config, inputs, {"store": config.store.store_dir})
    return result


def main(argv: list[str] | None = None, recipes=None) -> int:
    """Parse the flags, check the memory estimate, extract; returns the exit code (2: bad input, one line)."""
    config, invocation = parse_config(argv, "extract", ExtractConfig, FLAGS, __doc__, recipes)

    def extract_and_report() -> None:
        result = run(config, invocation)
        if is_rank0():
            rate = result.num_tokens / result.seconds if result.seconds else 0.0
            print(
                f"extract: wrote {result.num_samples} samples ({result.num_tokens} tokens, {rate:.0f} tokens/s on "
                f"rank 0's writer), skipped {result.num_skipped} complete; store {config.store.store_dir}"
            )

    return exit_code(extract_and_report)  # also a mismatching store and a read-only or full disk


if __name__ == "__main__":
    # Deprecated for one release: hands over to the job door (`python -m megatron_osprey extract`) by exec,
    # so the job never imports this file twice; the recipe registry above the stages is the door's to import.
    from megatron_osprey.stages.cli import deprecated_module_door

    deprecated_module_door("extract")
