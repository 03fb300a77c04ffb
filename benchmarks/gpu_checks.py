"""The device checks themselves (benchmarks/gpu_check.py runs them under its time budget): the shapes each
runs at on a GPU and in the CPU dry run, and one function per check returning its figures."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import tempfile

import torch

MIB = 1 << 20
GIB = 1 << 30


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


def release() -> None:
    """Free what the last model built (Megatron's DDP hooks close over the module: cycles only gc breaks)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def peak_fields(plan_bytes: int | None = None) -> dict:
    """The device's peak allocated memory since the last reset, beside the plan's figure for the same shapes."""
    fields = {"plan_gib": round(plan_bytes / GIB, 3)} if plan_bytes is not None else {}
    if torch.cuda.is_available():
        fields["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
        torch.cuda.reset_peak_memory_stats()
    else:
        fields["peak_gib"] = None  # the CPU dry run: no device allocator to ask
    return fields


def drafter_plan_bytes(arch, seq: int, bf16: bool, ttt_steps: int) -> int:
    """`osprey plan`'s figure for one drafter training step at these shapes (launcher.plan.drafter_step_memory)."""
    from launcher.plan import drafter_step_memory
    from megatron_osprey.stages.distill import DistillConfig

    config = DistillConfig()
    config.drafter.bf16, config.ttt.ttt_steps = bf16, ttt_steps
    config.training.seq_length, config.training.micro_batch_size, config.training.global_batch_size = seq, 1, 1
    return sum(b for _, b in drafter_step_memory(arch, config))


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


def _drafter_chunks(sizes: Sizes, state, distributed_optimizer: bool, impl: str = "auto"):
    from megatron_osprey.models.drafter.model import build_drafter_model
    from megatron_osprey.training.setup import build_model_chunks

    arch = _drafter_arch(sizes.body, sizes.target_hidden)
    bf16 = state.device.type == "cuda"
    dtype = torch.bfloat16 if bf16 else None
    provider = lambda **_: build_drafter_model(arch, state.config, transformer_impl=impl, params_dtype=dtype)  # noqa: E731
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


def _drafter_step(sizes: Sizes, state, distributed_optimizer: bool, impl: str = "auto") -> dict:
    from megatron_osprey.models.target.lm_head import TargetHead
    from megatron_osprey.stages.distill import DistillConfig
    from megatron_osprey.training.distillation import distill_forward_step
    from megatron_osprey.training.loop import train_step

    release()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    arch, model = _drafter_chunks(sizes, state, distributed_optimizer, impl)
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
    # The plan's drafter terms plus the TargetHead's float32 rows this step holds (as the plan's "target LM head").
    plan = drafter_plan_bytes(arch, sizes.seq, state.device.type == "cuda", cfg.ttt.ttt_steps) + v * ht * 4
    return {"loss": result.loss, "grad_norm": result.grad_norm, **peak_fields(plan)}


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

    release()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    arch, model = _backbone_chunks(sizes, state, distributed_optimizer)
    run, section = _run(model, state, sizes.seq, distributed_optimizer)
    result = train_step(gpt_forward_step, _backbone_batches(arch.vocab_size, sizes.seq, state.device), run)
    return {"loss": result.loss, "grad_norm": result.grad_norm, **peak_fields()}, run, section


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
    return emit("placement", not off, device=str(state.device), off_device=off[:20], **peak_fields())


def check_train_steps(sizes: Sizes, state) -> dict:
    results = {}
    for distributed_optimizer in (False, True):
        tag = "distopt" if distributed_optimizer else "ddp"
        results[f"drafter_{tag}"] = _drafter_step(sizes, state, distributed_optimizer)
        release()  # each model and its Adam states go before the next is built
        results[f"backbone_{tag}"] = _backbone_step(sizes, state, distributed_optimizer)[0]
        release()
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
        **peak_fields(),
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
        # The local spec: TE runs float32 GEMMs in TF32, which is no defect but would fail a 1e-4 comparison.
        model = build_drafter_model(arch, state.config, transformer_impl="local")
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
        transformer_impl="local",
        **peak_fields(),
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
