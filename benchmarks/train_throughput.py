"""Training throughput of the Stage 2 backbone shape: tokens/s, TFLOP/s, MFU and peak memory.

The model is Qwen3-4B's first 2 layers (hidden 2560, 32 heads, 8 kv heads, head_dim
128, ffn 9728, vocab 151,936, tied) with random weights, trained through the real
stack (DDP, Megatron optimizer, pipeline schedules, the Stage 2 forward step).

    python benchmarks/train_throughput.py                      # CPU: seq 256, batch 1 (say so)
    torchrun --nproc_per_node=8 benchmarks/train_throughput.py --bf16 --micro-batch-size 4
    python benchmarks/train_throughput.py --bf16 --fp8-format hybrid   # GPU with Transformer Engine
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

QWEN3_4B_2LAYER = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "num_hidden_layers": 2,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "eos_token_id": 151645,
}


# A toy shape of the same family, for the CPU dry run of benchmarks/gpu_check.py.
TINY = {
    **QWEN3_4B_2LAYER,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
}
SHAPES = {"qwen3_4b_2layer": QWEN3_4B_2LAYER, "tiny": TINY}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3_4b_2layer")
    parser.add_argument("--seq-length", type=int, default=None, help="default 4096 on GPU, 256 on CPU")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--num-microbatches", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20 GPU, 3 CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 5 GPU, 1 CPU)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None)
    parser.add_argument("--fp8-recipe", default="delayed")
    parser.add_argument("--transformer-impl", default="auto")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=None, help="per-device peak for MFU")
    parser.add_argument("--json-out", default=None)
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    seq = args.seq_length or (4096 if on_gpu else 256)
    steps = args.steps or (20 if on_gpu else 3)
    warmup = args.warmup if args.warmup is not None else (5 if on_gpu else 1)

    from megatron_osprey.base.arch import ModelArch
    from megatron_osprey.models.backbone.config import validate_numerics
    from megatron_osprey.parallel import ParallelConfig, parallel_context
    from megatron_osprey.stages.pretrain import PretrainConfig

    cfg = PretrainConfig()
    cfg.model.bf16, cfg.model.transformer_impl = args.bf16, args.transformer_impl
    cfg.model.fp8_format, cfg.model.fp8_recipe = args.fp8_format, args.fp8_recipe
    validate_numerics(cfg.model)
    cfg.parallel = ParallelConfig(tensor_model_parallel_size=args.tensor_model_parallel_size)
    arch = ModelArch.from_hf_config(SHAPES[args.shape])
    with parallel_context(cfg.parallel) as state:
        bench = _build(args, arch, cfg, state, seq, warmup + steps)
        elapsed, result = _timed_steps(bench, _random_batches(args, arch, state, seq), warmup, steps, on_gpu)
        report = _report(args, arch, state, bench, seq, steps, elapsed, result, on_gpu)
        if state.rank == 0:
            _print(report, args, on_gpu)
    return report


@dataclasses.dataclass
class _Bench:
    """What the timed loop runs: the model chunks, the training run around them, and the FLOP model."""

    model: list
    run: object
    global_batch_size: int
    flops_per_iter: float
    peak_tflops: float | None


def _build(args, arch, cfg, state, seq: int, iters: int) -> _Bench:
    """The backbone's model chunks, optimizer and TrainRun at this layout, and the step's FLOPs."""
    from megatron_osprey.training.config import OptimizerConfig
    from megatron_osprey.training.flops import device_peak_tflops, training_flops_per_sequence
    from megatron_osprey.training.loop import TrainRun
    from megatron_osprey.training.metrics import MetricsLogger, ThroughputModel
    from megatron_osprey.training.pretraining import model_provider
    from megatron_osprey.training.setup import build_model_chunks, build_optimizer_and_scheduler

    gbs = args.micro_batch_size * args.num_microbatches * state.dp_size
    cfg.training.micro_batch_size, cfg.training.global_batch_size = args.micro_batch_size, gbs
    cfg.training.seq_length, cfg.training.train_iters = seq, iters
    section = OptimizerConfig(
        lr=1e-4, min_lr=1e-5, lr_decay_style="constant", use_distributed_optimizer=args.use_distributed_optimizer
    )
    distributed_optimizer = args.use_distributed_optimizer
    model = build_model_chunks(
        model_provider(arch, cfg), cfg.parallel, bf16=args.bf16, use_distributed_optimizer=distributed_optimizer
    )
    optimizer, scheduler = build_optimizer_and_scheduler(model, section, bf16=args.bf16, train_iters=iters)
    head_width = arch.padded_vocab_size(args.tensor_model_parallel_size)
    flops_per_iter = gbs * training_flops_per_sequence(arch, seq, head_width)
    peak = device_peak_tflops(args.peak_tflops, fp8=bool(args.fp8_format))
    throughput = ThroughputModel(gbs * seq, flops_per_iter, state.world_size, peak)
    metrics = MetricsLogger(cfg.logging, throughput, is_writer=False, total_iters=iters, start_iter=0)
    run = TrainRun(
        model, optimizer, scheduler, cfg.training, cfg.checkpoint, cfg.logging, metrics, None, state.dp_size,
        state.device,
    )  # fmt: skip
    return _Bench(model, run, gbs, flops_per_iter, peak)


def _random_batches(args, arch, state, seq: int):
    """Endless random token batches on the device, each data-parallel rank its own stream."""
    generator = torch.Generator().manual_seed(state.dp_rank)
    while True:
        tokens = torch.randint(0, arch.vocab_size, (args.micro_batch_size, seq + 1), generator=generator)
        yield {
            "tokens": tokens[:, :-1].to(state.device),
            "labels": tokens[:, 1:].to(state.device),
            "loss_mask": torch.ones(args.micro_batch_size, seq, device=state.device),
            "position_ids": torch.arange(seq, device=state.device).expand(args.micro_batch_size, seq),
        }


def _timed_steps(bench: _Bench, data, warmup: int, steps: int, on_gpu: bool):
    """(seconds of the `steps` timed steps after `warmup` untimed ones, the last step's result)."""
    from megatron_osprey.training.gpt_step import gpt_forward_step
    from megatron_osprey.training.loop import train_step

    for _ in range(warmup):
        train_step(gpt_forward_step, data, bench.run)
    if on_gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        result = train_step(gpt_forward_step, data, bench.run)
    if on_gpu:
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def _report(args, arch, state, bench: _Bench, seq, steps, elapsed, result, on_gpu) -> dict:
    from megatron_osprey.training.metrics import peak_memory_gib

    memory, memory_source = peak_memory_gib()
    gbs, peak = bench.global_batch_size, bench.peak_tflops
    tflops = bench.flops_per_iter * steps / elapsed / state.world_size / 1e12
    return {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "world_size": state.world_size,
        "seq_length": seq,
        "global_batch_size": gbs,
        "precision": ("fp8-" + args.fp8_format) if args.fp8_format else ("bf16" if args.bf16 else "fp32"),
        "transformer_impl": unwrap_impl(bench.model),
        "params": arch.num_parameters(),
        "step_time_s": elapsed / steps,
        "tokens_per_sec_per_device": gbs * seq * steps / elapsed / state.world_size,
        "tflops_per_device": tflops,
        "mfu": tflops / peak if peak else None,
        "peak_tflops": peak,
        "peak_memory_gib": memory,
        "peak_memory_source": memory_source,
        "last_loss": result.loss,
    }


def _print(report: dict, args, on_gpu: bool) -> None:
    for key, value in report.items():
        print(f"{key:>28}: {value}")
    if not on_gpu:
        print("note: CPU run with a short sequence and batch (--seq-length to change); MFU needs --peak-tflops on CPU.")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)


def unwrap_impl(model) -> str:
    from megatron.core.utils import unwrap_model

    return getattr(unwrap_model(model[0]), "transformer_impl", "?")


if __name__ == "__main__":
    main()
