#!/usr/bin/env python
"""The prepared device check: one call on one GPU proves what a CPU cannot. One JSON line per check.

    python benchmarks/gpu_check.py               # one GPU (sized for one H200, about 5 minutes)
    python benchmarks/gpu_check.py --dry-run     # CPU, toy sizes: the same code paths (tests run this)
    python benchmarks/gpu_check.py --only ttt_memory ttt_loss

Checks (each line: {"check": NAME, "ok": true|false, ...figures}; a check that raises, or runs past its time,
prints ok false and its error, and the next check still runs). A lent GPU gives about 15 minutes of device time,
start-up included, so the checks share --total-budget seconds (default 480): each gets its weighted share of what
remains, at most --check-timeout; a check left without time prints "skipped: budget spent"; a check stuck where the
alarm cannot reach it (inside a C call) ends the run at the budget. The last line: {"summary": "gpu_check", "ok",
"elapsed_s", "total_budget_s", "failed", "skipped"}.
  init         torch.distributed up with NCCL and the CPU compatibility layer off (an NCCL all-reduce).
  placement    every parameter, buffer and rotary table of the drafter and the backbone on the GPU.
  train_steps  one BF16 training step of the drafter (TTT loss) and of the backbone (LM loss), each
               with and without the distributed optimizer: finite losses and grad norms.
  checkpoint   a training checkpoint saved, then loaded into fresh chunks (bitwise equal weights); and
               its model weights loaded into the other optimizer layout's model through the dist-ckpt
               reshard path. One GPU cannot change TP/PP: tests/distributed covers that on CPU.
  ttt_memory   peak memory of one layer's TTT attention (forward + backward) at seq 4096, K = 1..5
               with Osprey's Qwen3 drafter heads (32 q, 8 kv, head_dim 128, BF16) against
               `ttt_attention_bytes` (what `osprey plan` budgets), and the old exact attention at K 1-2.
  ttt_loss     the Megatron drafter's TTT loss on the GPU (float32) against the plain-PyTorch
               reference drafter's on the CPU, same weights and batch.
  throughput   BF16 tokens/s and MFU of the 2-layer Qwen3-4B backbone shape with the local spec
               (benchmarks/train_throughput.py, seq 4096).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

CHECKS = ("init", "placement", "train_steps", "checkpoint", "ttt_memory", "ttt_loss", "throughput")
# Relative shares of the total budget, by the work each does (the real run is not timed yet): train_steps builds
# four models and pays the first step's compilation of the fused ops, checkpoint builds three and saves, ttt_memory
# runs seven attention passes at seq 4096, throughput 13 steps; init builds nothing, placement and ttt_loss two.
WEIGHTS = dict(init=1, placement=1, train_steps=3, checkpoint=2, ttt_memory=2, ttt_loss=1, throughput=2)
MIN_CHECK_S = 1.0  # a share below this cannot even build a model: the check is skipped
WATCHDOG_GRACE_S = 5.0  # past the budget, a check the alarm could not stop ends the run
MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each check runs at: the real shapes on a GPU, toy ones for the CPU dry run."""

    body: dict  # the drafter / backbone body (HF config)
    target_hidden: int
    seq: int
    memory_seq: int
    memory_heads: tuple[int, int, int]  # q heads, kv heads, head_dim
    loss_body: dict
    loss_seq: int
    throughput_args: tuple[str, ...]


def _qwen3(layers, hidden, heads, kv, head_dim, ffn, vocab, tie=True) -> dict:
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": tie,
        "torch_dtype": "bfloat16",
    }


GPU = Sizes(
    body=_qwen3(2, 2560, 32, 8, 128, 9728, 151936),
    target_hidden=4096,
    seq=4096,
    memory_seq=4096,
    memory_heads=(32, 8, 128),
    loss_body=_qwen3(2, 512, 8, 2, 64, 1024, 8192),
    loss_seq=512,
    throughput_args=("--bf16", "--transformer-impl", "local", "--seq-length", "4096", "--steps", "10", "--warmup", "3"),
)
TOY = Sizes(
    body=_qwen3(2, 64, 4, 2, 32, 128, 512),
    target_hidden=48,
    seq=32,
    memory_seq=128,
    memory_heads=(4, 2, 16),
    loss_body=_qwen3(2, 64, 4, 2, 32, 128, 512),
    loss_seq=24,
    throughput_args=("--shape", "tiny", "--seq-length", "32", "--steps", "1", "--warmup", "0"),
)


def emit(check: str, ok: bool, **fields) -> dict:
    line = {"check": check, "ok": bool(ok), **fields}
    print(json.dumps(line, default=str), flush=True)
    return line


def _drafter_arch(body: dict, target_hidden: int):
    from megatron_osprey.base.arch import ModelArch
    from megatron_osprey.models.drafter.arch import DrafterArch

    vocab = body["vocab_size"]
    return DrafterArch(
        body=ModelArch.from_hf_config(body),
        target_hidden_size=target_hidden,
        vocab_size=vocab,
        draft_vocab_size=vocab,
        aux_layer_ids=(1, 2, 3),
    )


# ----------------------------------------------------------------------------- training runs


def _run(model, state, seq: int, distributed_optimizer: bool):
    """A TrainRun of one micro-batch per step around `model` (DDP chunks)."""
    from megatron_osprey.training.config import CheckpointConfig, LoggingConfig, OptimizerConfig, TrainingConfig
    from megatron_osprey.training.loop import TrainRun
    from megatron_osprey.training.setup import build_optimizer_and_scheduler

    section = OptimizerConfig(
        lr=1e-4, min_lr=1e-5, lr_decay_style="constant", use_distributed_optimizer=distributed_optimizer
    )
    bf16 = state.device.type == "cuda"
    optimizer, scheduler = build_optimizer_and_scheduler(model, section, bf16=bf16, train_iters=10)
    training = TrainingConfig(micro_batch_size=1, global_batch_size=state.dp_size, seq_length=seq, train_iters=10)
    return TrainRun(
        model,
        optimizer,
        scheduler,
        training,
        CheckpointConfig(),
        LoggingConfig(),
        None,
        None,
        state.dp_size,
        state.device,
    ), section


def _drafter_chunks(sizes: Sizes, state, distributed_optimizer: bool):
    from megatron_osprey.models.drafter.model import build_drafter_model
    from megatron_osprey.training.setup import build_model_chunks

    arch = _drafter_arch(sizes.body, sizes.target_hidden)
    bf16 = state.device.type == "cuda"
    provider = lambda **_: build_drafter_model(arch, state.config, params_dtype=torch.bfloat16 if bf16 else None)  # noqa: E731
    return arch, build_model_chunks(provider, state.config, bf16=bf16, use_distributed_optimizer=distributed_optimizer)


def _backbone_chunks(sizes: Sizes, state, distributed_optimizer: bool):
    from megatron_osprey.base.arch import ModelArch
    from megatron_osprey.stages.pretrain import PretrainConfig
    from megatron_osprey.training.pretraining import model_provider
    from megatron_osprey.training.setup import build_model_chunks

    arch = ModelArch.from_hf_config(sizes.body)
    cfg = PretrainConfig()
    cfg.model.bf16, cfg.model.transformer_impl, cfg.parallel = state.device.type == "cuda", "local", state.config
    return arch, build_model_chunks(
        model_provider(arch, cfg), state.config, bf16=cfg.model.bf16, use_distributed_optimizer=distributed_optimizer
    )


def _drafter_step(sizes: Sizes, state, distributed_optimizer: bool) -> dict:
    from megatron_osprey.models.target.lm_head import TargetHead
    from megatron_osprey.stages.distill import DistillConfig
    from megatron_osprey.training.distillation import distill_forward_step
    from megatron_osprey.training.loop import train_step

    arch, model = _drafter_chunks(sizes, state, distributed_optimizer)
    run, _ = _run(model, state, sizes.seq, distributed_optimizer)
    gen = torch.Generator().manual_seed(0)
    v, ht = arch.vocab_size, arch.target_hidden_size
    head = TargetHead(
        torch.ones(ht), 1e-6, 0.02 * torch.randn(v, ht, generator=gen), None, v, torch.ones(v, dtype=torch.bool)
    ).to(state.device)
    cfg = DistillConfig()

    def batches():
        while True:
            yield {
                k: t.to(state.device)
                for k, t in {
                    "input_ids": torch.randint(0, v, (1, sizes.seq), generator=gen),
                    "loss_mask": torch.ones(1, sizes.seq, dtype=torch.bool),
                    "aux_hidden": torch.randn(1, sizes.seq, 3 * ht, generator=gen),
                    "final_hidden": torch.randn(1, sizes.seq, ht, generator=gen),
                    "lengths": torch.tensor([sizes.seq]),
                }.items()
            }

    result = train_step(distill_forward_step(None, head, cfg, v, None), batches(), run)
    return {"loss": result.loss, "grad_norm": result.grad_norm}


def _backbone_batches(vocab: int, seq: int, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, vocab, (1, seq + 1), generator=gen)
        yield {
            "tokens": tokens[:, :-1].to(device),
            "labels": tokens[:, 1:].to(device),
            "loss_mask": torch.ones(1, seq, device=device),
            "position_ids": torch.arange(seq, device=device)[None],
        }


def _backbone_step(sizes: Sizes, state, distributed_optimizer: bool):
    from megatron_osprey.training.gpt_step import gpt_forward_step
    from megatron_osprey.training.loop import train_step

    arch, model = _backbone_chunks(sizes, state, distributed_optimizer)
    run, section = _run(model, state, sizes.seq, distributed_optimizer)
    result = train_step(gpt_forward_step, _backbone_batches(arch.vocab_size, sizes.seq, state.device), run)
    return {"loss": result.loss, "grad_norm": result.grad_norm}, run, section


# ----------------------------------------------------------------------------- checks


def check_init(sizes: Sizes, state) -> dict:
    from megatron_osprey.models.backbone.gpu_support import c_compiler
    from megatron_osprey.parallel import cpu_compat

    backend = torch.distributed.get_backend()
    total = torch.ones(1, device=state.device)
    torch.distributed.all_reduce(total)
    on_gpu = state.device.type == "cuda"
    ok = float(total) == state.world_size and (backend == "nccl" and not cpu_compat.is_active() if on_gpu else True)
    return emit(
        "init",
        ok,
        backend=backend,
        compat_active=cpu_compat.is_active(),
        device=str(state.device),
        world_size=state.world_size,
        torch=torch.__version__,
        # Inductor (Megatron's fused ops) needs one; without it the fusions are off (one warning at build).
        c_compiler=c_compiler() or "missing: fusions off, install gcc",
    )


def _off_device(module, device) -> list[str]:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    named = list(module.named_parameters()) + list(module.named_buffers())
    named += [(f"{n}.inv_freq", m.inv_freq) for n, m in module.named_modules() if isinstance(m, RotaryEmbedding)]
    return [name for name, tensor in named if tensor.device != device]


def check_placement(sizes: Sizes, state) -> dict:
    _, drafter = _drafter_chunks(sizes, state, False)
    _, backbone = _backbone_chunks(sizes, state, False)
    off = _off_device(drafter[0], state.device) + _off_device(backbone[0], state.device)
    return emit("placement", not off, device=str(state.device), off_device=off[:20])


def check_train_steps(sizes: Sizes, state) -> dict:
    results = {}
    for distributed_optimizer in (False, True):
        tag = "distopt" if distributed_optimizer else "ddp"
        results[f"drafter_{tag}"] = _drafter_step(sizes, state, distributed_optimizer)
        results[f"backbone_{tag}"] = _backbone_step(sizes, state, distributed_optimizer)[0]
    finite = all(
        math.isfinite(r["loss"]) and r["grad_norm"] is not None and math.isfinite(r["grad_norm"])
        for r in results.values()
    )
    dtype = "bf16" if state.device.type == "cuda" else "fp32"
    return emit("train_steps", finite, dtype=dtype, seq=sizes.seq, **results)


def check_checkpoint(sizes: Sizes, state) -> dict:
    from megatron.core.utils import unwrap_model

    from megatron_osprey.training import checkpointing
    from megatron_osprey.training.optimizer import sharding_metadata
    from megatron_osprey.training.setup import place_on_device

    _, run, section = _backbone_step(sizes, state, True)
    metadata = sharding_metadata(section)
    with tempfile.TemporaryDirectory() as tmp:
        checkpointing.save_training_checkpoint(
            tmp, 1, 1, run.model, run.optimizer, run.scheduler, {"check": "gpu_check"}, metadata
        )
        torch.manual_seed(123)  # fresh chunks with other weights
        _, fresh, _ = _backbone_step(sizes, state, True)
        checkpointing.load_training_checkpoint(tmp, fresh.model, fresh.optimizer, fresh.scheduler, metadata)
        same = _max_diff(run.model[0], fresh.model[0])
        # The model weights into a model of the other optimizer layout, through dist-ckpt's reshard path.
        _, other = _backbone_chunks(sizes, state, False)
        bare = unwrap_model(other[0])
        checkpointing.load_model_weights(tmp, bare)
        place_on_device([bare], state.device)
        other_diff = _max_diff(run.model[0], other[0])
    return emit(
        "checkpoint",
        same == 0.0 and other_diff == 0.0,
        resumed_max_abs_diff=same,
        other_layout_max_abs_diff=other_diff,
        note="one device: TP/PP resharding is covered by tests/distributed on CPU",
    )


def _max_diff(a, b) -> float:
    from megatron.core.utils import unwrap_model

    pa, pb = dict(unwrap_model(a).named_parameters()), dict(unwrap_model(b).named_parameters())
    return max(float((pa[n].detach().float() - pb[n].detach().float()).abs().max()) for n in pa)


def check_ttt_memory(sizes: Sizes) -> dict:
    import ttt_attention_memory as bench

    from megatron_osprey.base.memory import ttt_attention_bytes

    heads, kv, dim = sizes.memory_heads
    on_gpu = torch.cuda.is_available()
    dtype, dtype_bytes = ("bfloat16", 2) if on_gpu else ("float32", 4)
    args = argparse.Namespace(heads=heads, kv_heads=kv, head_dim=dim, device="cuda" if on_gpu else "cpu", dtype=dtype)
    curve, ok = [], True
    for steps in range(1, 6):
        for impl in ("linear", "exact") if steps <= 2 else ("linear",):
            if on_gpu:
                torch.cuda.empty_cache()
            # In this process: CUDA's peak counter and the CPU's VmHWM are both reset per point.
            row = bench.measure(impl, sizes.memory_seq, steps, heads, kv, dim, args.device, dtype)
            plan = ttt_attention_bytes(1, heads, sizes.memory_seq, dim, steps, dtype_bytes, kv) / MIB
            if impl == "linear":
                ok &= row["peak_mib"] <= 1.5 * plan + 64  # inputs' grads and allocator slack
            curve.append({"impl": impl, "K": steps, "peak_mib": row["peak_mib"], "plan_mib": round(plan, 1)})
    return emit(
        "ttt_memory", ok, seq=sizes.memory_seq, heads=heads, kv_heads=kv, head_dim=dim, dtype=dtype, curve=curve
    )


def check_ttt_loss(sizes: Sizes, state) -> dict:
    from megatron_osprey.losses.ttt import TTTLossConfig, drafter_inputs, ttt_loss
    from megatron_osprey.models.drafter.convert import load_reference_state
    from megatron_osprey.models.drafter.model import build_drafter_model
    from megatron_osprey.models.drafter.reference import ReferenceDrafter
    from megatron_osprey.training.setup import place_on_device

    arch = _drafter_arch(sizes.loss_body, 96)
    torch.manual_seed(11)
    reference = ReferenceDrafter(arch.reference_config())
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.05 * torch.randn_like(param))  # W_new != 0: every step depends on g
    gen = torch.Generator().manual_seed(7)
    v, s, config = arch.vocab_size, sizes.loss_seq, TTTLossConfig(ttt_steps=5)
    ids = torch.randint(0, v, (2, s), generator=gen)
    aux = torch.randn(2, s, 3 * 96, generator=gen)
    target_logits = 3 * torch.randn(2, s, v, generator=gen)
    mask, in_draft = torch.rand(2, s, generator=gen) > 0.2, torch.ones(2, s, dtype=torch.bool)
    with torch.no_grad():
        cpu_loss, _ = ttt_loss(
            reference.ttt_forward(drafter_inputs(ids), aux, 5), target_logits, mask, in_draft, v, config
        )
        model = build_drafter_model(arch, state.config)
        load_reference_state(model, reference.state_dict(), 0, 1)
        place_on_device([model], state.device)
        logits, _ = model.ttt_forward(drafter_inputs(ids).to(state.device), aux.to(state.device), 5)
        dev = state.device
        dev_loss, _ = ttt_loss(
            [x[..., :v] for x in logits], target_logits.to(dev), mask.to(dev), in_draft.to(dev), v, config
        )
    rel = abs(float(dev_loss) - float(cpu_loss)) / abs(float(cpu_loss))
    return emit(
        "ttt_loss",
        rel < 1e-4,
        device=str(state.device),
        loss_device=float(dev_loss),
        loss_cpu_reference=float(cpu_loss),
        relative_diff=rel,
    )


def check_throughput(sizes: Sizes) -> dict:
    import train_throughput

    report = train_throughput.main(list(sizes.throughput_args))
    return emit(
        "throughput",
        math.isfinite(report["last_loss"]) and report["tokens_per_sec_per_device"] > 0,
        **{
            k: report[k]
            for k in (
                "device",
                "precision",
                "transformer_impl",
                "seq_length",
                "tokens_per_sec_per_device",
                "tflops_per_device",
                "mfu",
                "peak_memory_gib",
                "step_time_s",
            )
        },
    )


def _free_memory() -> None:
    """Drop what the last check built (its models, optimizers, cached blocks) before the next one."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


class CheckTimeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise CheckTimeout(
        "ran past its time (its share of --total-budget, at most --check-timeout; a child process may have died "
        "while the check waited on it)"
    )


def _guarded(name: str, limit_s: float, fn, *args) -> dict:
    """Run one check; an error or running past limit_s prints its failing line and the next check runs."""
    start = time.perf_counter()
    # A check that waits forever (a dead writer process in a checkpoint save) must not take the whole window.
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        line = fn(*args)
    except Exception as err:  # one failing check must not hide the others
        line = emit(
            name,
            False,
            error=f"{type(err).__name__}: {err}",
            traceback=traceback.format_exc()[-2000:],
            seconds=round(time.perf_counter() - start, 1),
            limit_s=round(limit_s, 1),
        )
        traceback.clear_frames(err.__traceback__)  # the frames hold the check's models alive
        del err
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    _free_memory()
    return line


class Budget:
    """The device window shared by the checks: each gets its weighted share of what remains, at most check_timeout.

    A watchdog thread ends the process WATCHDOG_GRACE_S after the budget when a check is stuck where SIGALRM cannot
    reach it (a C call that never returns, a hung collective), printing the lines the run still owes.
    """

    def __init__(self, total_s: float, check_timeout_s: float, names: list[str]):
        self.total_s, self.check_timeout_s = total_s, check_timeout_s
        self.pending, self.current, self.lines = list(names), None, []
        self.start = time.perf_counter()
        self._watchdog = threading.Timer(total_s + WATCHDOG_GRACE_S, self._overrun)
        self._watchdog.daemon = True
        self._watchdog.start()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def share(self, name: str) -> float:
        weights = sum(WEIGHTS[n] for n in self.pending)
        return min(self.check_timeout_s, (self.total_s - self.elapsed()) * WEIGHTS[name] / weights)

    def run(self, name: str, fn, *args) -> dict:
        """Run check `name` within its share, or print that it is skipped when the budget is spent."""
        limit = self.share(name)
        self.current = name
        self.pending.remove(name)
        if limit < MIN_CHECK_S:
            line = emit(name, False, error="skipped: budget spent", skipped=True, elapsed_s=round(self.elapsed(), 1))
        else:
            line = _guarded(name, limit, fn, *args)
        self.current = None
        self.lines.append(line)
        return line

    def summary(self) -> dict:
        self._watchdog.cancel()
        return _summary(self.lines, self.elapsed(), self.total_s)

    def _overrun(self) -> None:
        if self.current:
            self.lines.append(emit(self.current, False, error="ran past --total-budget where no alarm reaches"))
        for name in self.pending:
            self.lines.append(emit(name, False, error="skipped: budget spent", skipped=True))
        _summary(self.lines, self.elapsed(), self.total_s)
        os._exit(1)  # the main thread is stuck: nothing else ends it within the window


def _summary(lines: list[dict], elapsed_s: float, total_s: float) -> dict:
    line = {
        "summary": "gpu_check",
        "ok": bool(lines) and all(line["ok"] for line in lines),
        "elapsed_s": round(elapsed_s, 1),
        "total_budget_s": total_s,
        "failed": [line["check"] for line in lines if not line["ok"] and not line.get("skipped")],
        "skipped": [line["check"] for line in lines if line.get("skipped")],
    }
    print(json.dumps(line), flush=True)
    return line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU (no GPU needed)")
    parser.add_argument("--only", nargs="+", choices=CHECKS, default=list(CHECKS))
    parser.add_argument(
        "--check-timeout", type=float, default=180, metavar="S", help="seconds one check may run (default 180)"
    )
    parser.add_argument(
        "--total-budget",
        type=float,
        default=480,
        metavar="S",
        help="seconds all checks may take together (default 480: a 15-minute device window less start-up)",
    )
    args = parser.parse_args(argv)
    if not args.check_timeout > 0 or not args.total_budget > 0:
        parser.error("--check-timeout and --total-budget must be > 0 seconds")
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --dry-run for the CPU toy run.", file=sys.stderr)
        return 2
    sizes = TOY if args.dry_run else GPU
    from megatron_osprey.parallel import ParallelConfig, parallel_context

    in_context = [c for c in ("init", "placement", "train_steps", "checkpoint", "ttt_loss") if c in args.only]
    alone = [c for c in ("ttt_memory", "throughput") if c in args.only]
    budget = Budget(args.total_budget, args.check_timeout, in_context + alone)
    if in_context:
        with parallel_context(ParallelConfig()) as state:
            table = {
                "init": check_init,
                "placement": check_placement,
                "train_steps": check_train_steps,
                "checkpoint": check_checkpoint,
                "ttt_loss": check_ttt_loss,
            }
            for name in in_context:
                budget.run(name, table[name], sizes, state)
    if "ttt_memory" in alone:
        budget.run("ttt_memory", check_ttt_memory, sizes)
    if "throughput" in alone:
        budget.run("throughput", check_throughput, sizes)
    return 0 if budget.summary()["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
