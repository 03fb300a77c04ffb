"""Extract a target's hidden states (aux layers + final pre-norm) for offline distillation.

Usage (one node, 8 GPUs, MiniMax-M2.5 with expert parallelism):

    torchrun --nproc_per_node=8 tools/extract_hidden_states.py --target /models/MiniMax-M2.5 \\
        --data conversations.jsonl --output /store/minimax --expert-model-parallel-size 8 \\
        --tensor-model-parallel-size 1 --gpu-memory-gib 139

Slurm array jobs: each task takes slice SLURM_ARRAY_TASK_ID of SLURM_ARRAY_TASK_COUNT
(or --shard i/n); the last task to finish merges the manifest. Reruns resume.
`python -m megatron_osprey.stages.extract` takes the same flags.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_osprey.base.arch import ModelArch, resolve_aux_layer_ids
from megatron_osprey.base.memory import check_fits, estimate_target_memory
from megatron_osprey.data.extract import ExtractConfig, ExtractResult, extract_hidden_states
from megatron_osprey.data.hidden_state_store import HiddenStateStoreConfig
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.stages.cli import config_from_flags, exit_code, is_rank0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="HF checkpoint directory of the target model")
    parser.add_argument("--data", required=True, help="conversations JSONL")
    parser.add_argument("--output", required=True, help="hidden-state store directory")
    parser.add_argument(
        "--aux-layer-ids",
        type=int,
        nargs="+",
        default=None,
        help="0-based target layers whose outputs are stored (default 1, L//2-1, L-4)",
    )
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--expert-model-parallel-size", type=int, default=1)
    parser.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10.0,
        help="collective timeout; raise it when loading a large (e.g. FP8-dequantised MoE) target is slow",
    )
    parser.add_argument("--shard", default=None, help="i/n: take slice i of n (default: Slurm array task, else 0/1)")
    parser.add_argument("--encoding", choices=("bf16", "int8"), default="bf16")
    parser.add_argument("--samples-per-shard", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--params-dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    parser.add_argument("--transformer-impl", default="auto", choices=("auto", "local", "transformer_engine"))
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="refuse layouts whose per-GPU estimate exceeds this (default: the device's memory)",
    )
    parser.add_argument("--enable-thinking", choices=("true", "false"), default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="delete a store made from other data, another target or other settings (default: refuse)",
    )
    return parser.parse_args(argv)


def parse_shard(text: str | None, environ) -> tuple[int, int]:
    """--shard i/n, else SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT, else 0/1."""
    if text:
        try:
            index, count = (int(x) for x in text.split("/"))
        except ValueError:
            raise ValueError(f"--shard must look like i/n (e.g. 3/16), got {text!r}.") from None
        return index, count
    if "SLURM_ARRAY_TASK_ID" in environ:
        count = int(environ.get("SLURM_ARRAY_TASK_COUNT", "0"))
        if count < 1:
            raise ValueError("SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_COUNT is not; pass --shard i/n.")
        # Arrays may start at a non-zero id (--array=1-16): count from SLURM_ARRAY_TASK_MIN.
        first = int(environ.get("SLURM_ARRAY_TASK_MIN", "0"))
        return int(environ["SLURM_ARRAY_TASK_ID"]) - first, count
    return 0, 1


def device_memory_gib() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30


def preflight_memory(args: argparse.Namespace, say=print) -> None:
    """Print the per-GPU estimate; refuse (TargetMemoryError) when it exceeds the GPU's memory."""
    arch = ModelArch.from_hf_config(args.target)
    arch.validate_parallel(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    )
    if arch.is_moe and args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        raise ValueError("a mixture-of-experts target with --tensor-model-parallel-size > 1 needs --sequence-parallel.")
    aux = resolve_aux_layer_ids(args.aux_layer_ids, arch.num_layers)
    estimate = estimate_target_memory(
        arch,
        tensor_parallel=args.tensor_model_parallel_size,
        pipeline_parallel=args.pipeline_model_parallel_size,
        expert_parallel=args.expert_model_parallel_size,
        expert_tensor_parallel=args.expert_tensor_parallel_size,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.max_length,
        num_captured_layers=len(aux) + 1,
    )
    say(estimate.summary())
    budget = args.gpu_memory_gib if args.gpu_memory_gib is not None else device_memory_gib()
    if budget is not None:
        check_fits(estimate, budget)


def run(config: ExtractConfig, parallel: ParallelConfig) -> ExtractResult:
    """Check the config before any process group exists, then extract this rank's slice (collective)."""
    config.validate()
    with parallel_context(parallel) as state:
        return extract_hidden_states(config, state)


def main(argv=None) -> int:
    """Parse the flags, check the memory estimate, extract; returns the exit code (2: bad input, one line)."""
    args = parse_args(argv)
    index, count = parse_shard(args.shard, os.environ)
    rank0 = is_rank0()
    preflight_memory(args, print if rank0 else (lambda _: None))
    thinking = None if args.enable_thinking is None else args.enable_thinking == "true"
    config = ExtractConfig(
        target_dir=args.target,
        data_path=args.data,
        store=HiddenStateStoreConfig(
            store_dir=args.output, encoding=args.encoding, samples_per_shard=args.samples_per_shard
        ),
        aux_layer_ids=tuple(args.aux_layer_ids) if args.aux_layer_ids else None,
        max_length=args.max_length,
        micro_batch_size=args.micro_batch_size,
        shard_index=index,
        num_shards=count,
        params_dtype=args.params_dtype,
        transformer_impl=args.transformer_impl,
        enable_thinking=thinking,
        overwrite=args.overwrite,
    )

    def extract_and_report() -> None:
        result = run(config, config_from_flags(ParallelConfig, args))
        if rank0:
            rate = result.num_tokens / result.seconds if result.seconds else 0.0
            print(
                f"extract: wrote {result.num_samples} samples ({result.num_tokens} tokens, {rate:.0f} tokens/s on "
                f"rank 0's writer), skipped {result.num_skipped} complete; store {args.output}"
            )

    return exit_code(extract_and_report)  # also a mismatching store and a read-only or full disk


if __name__ == "__main__":
    sys.exit(main())
