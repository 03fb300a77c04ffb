"""The device checks of what every GPU recipe builds and a CPU cannot: Megatron-Core's Transformer Engine spec (BF16
and FP8 delayed scaling, a checkpoint with TE's _extra_state), the drafter with TE, and the online target path from
a HF checkpoint written here (FP8 block-scaled, dequantized on the device) against the HF forward."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import torch
from gpu_checks import Sizes, _backbone_batches, _drafter_chunks, _drafter_step, _max_diff, _run, emit, peak_fields

TE_ABSENT = "absent: every GPU recipe builds the TE spec; install transformer_engine[pytorch] 2.11 in the image"


def _te_line(check: str, state) -> dict | None:
    """The line of a TE check where TE cannot run: failing on a GPU (the recipes need it), passing on the CPU."""
    from megatron_osprey.base.hardware import transformer_engine_usable

    if transformer_engine_usable():
        return None
    on_gpu = state.device.type == "cuda"
    return emit(check, not on_gpu, transformer_engine=TE_ABSENT if on_gpu else "absent: the CPU dry run")


def _te_backbone(sizes: Sizes, state, fp8: str | None):
    """The backbone GPT on the TE spec in BF16 (with `fp8` scaling, e4m3/hybrid), DDP chunks and a train run."""
    from megatron_osprey.base.arch import ModelArch
    from megatron_osprey.stages.pretrain import PretrainConfig
    from megatron_osprey.training.pretraining import model_provider
    from megatron_osprey.training.setup import build_model_chunks

    arch = ModelArch.from_hf_config(sizes.body)
    cfg = PretrainConfig()
    cfg.model.bf16, cfg.model.transformer_impl, cfg.parallel = True, "transformer_engine", state.config
    if fp8:
        cfg.model.fp8_format, cfg.model.fp8_recipe = "hybrid", fp8
    chunks = build_model_chunks(model_provider(arch, cfg), state.config, bf16=True, use_distributed_optimizer=False)
    run, section = _run(chunks, state, sizes.seq, False)
    return arch, run, section


def check_te_spec(sizes: Sizes, state) -> dict:
    from gpu_checks import release
    from megatron.core.utils import unwrap_model

    from megatron_osprey.training import checkpointing
    from megatron_osprey.training.gpt_step import gpt_forward_step
    from megatron_osprey.training.loop import train_step
    from megatron_osprey.training.optimizer import sharding_metadata

    absent = _te_line("te_spec", state)
    if absent:
        return absent
    results, ok = {}, True
    for label, fp8 in (("bf16", None), ("fp8_delayed", "delayed")):
        arch, run, section = _te_backbone(sizes, state, fp8)
        step = train_step(gpt_forward_step, _backbone_batches(arch.vocab_size, sizes.seq, state.device), run)
        results[label] = {"loss": step.loss, "grad_norm": step.grad_norm, **peak_fields()}
        ok &= math.isfinite(step.loss) and step.grad_norm is not None and math.isfinite(step.grad_norm)
        if fp8:  # save (TE's _extra_state holds the FP8 scales and amax history) and load into a fresh model
            extra = [k for k in unwrap_model(run.model[0]).state_dict() if k.endswith("_extra_state")]
            metadata = sharding_metadata(section)
            with tempfile.TemporaryDirectory() as tmp:
                checkpointing.save_training_checkpoint(
                    tmp, 1, 1, run.model, run.optimizer, run.scheduler, {"check": "te_spec"}, metadata
                )
                torch.manual_seed(321)
                _, fresh, _ = _te_backbone(sizes, state, fp8)
                checkpointing.load_training_checkpoint(tmp, fresh.model, fresh.optimizer, fresh.scheduler, metadata)
                diff = _max_diff(run.model[0], fresh.model[0])
            results["fp8_checkpoint"] = {"extra_state_keys": len(extra), "resumed_max_abs_diff": diff}
            ok &= bool(extra) and diff == 0.0
        del run
        release()
    return emit("te_spec", ok, seq=sizes.seq, **results)


def check_drafter_te(sizes: Sizes, state) -> dict:
    """The drafter as the recipes build it (TE linears, BF16): one TTT training step, and its TTT forward on the
    local spec's weights against the local spec's."""
    from megatron.core.utils import unwrap_model

    from megatron_osprey.losses.ttt import drafter_inputs

    absent = _te_line("drafter_te", state)
    if absent:
        return absent
    step = _drafter_step(sizes, state, False, impl="transformer_engine")
    torch.manual_seed(5)
    arch, local = _drafter_chunks(sizes, state, False, "local")
    _, te = _drafter_chunks(sizes, state, False, "transformer_engine")
    local_model, te_model = unwrap_model(local[0]), unwrap_model(te[0])
    missing, unexpected = te_model.load_state_dict(local_model.state_dict(), strict=False)
    gen = torch.Generator().manual_seed(1)
    seq = min(sizes.seq, 512)
    ids = torch.randint(0, arch.vocab_size, (1, seq), generator=gen).to(state.device)
    aux = torch.randn(1, seq, 3 * arch.target_hidden_size, generator=gen).to(state.device, torch.bfloat16)
    with torch.no_grad():
        want = local_model.ttt_forward(drafter_inputs(ids), aux, 3)[0][-1].float()
        got = te_model.ttt_forward(drafter_inputs(ids), aux, 3)[0][-1].float()
    rel = float((got - want).abs().max() / want.abs().max())
    missing = [k for k in missing if not k.endswith("_extra_state")]
    ok = math.isfinite(step["loss"]) and not missing and not unexpected and rel < 5e-2  # bf16, other kernels
    return emit(
        "drafter_te",
        ok,
        step=step,
        ttt_step2_logits_rel_diff_vs_local=rel,
        missing_keys=missing[:10],
        unexpected_keys=list(unexpected)[:10],
    )


def _quantize_fp8_blocks(weight: torch.Tensor, block: int):
    """Per-block e4m3 quantization as DeepSeek / MiniMax ship it: (fp8 weight, float32 scale_inv)."""
    rows, cols = weight.shape
    tiles = torch.nn.functional.pad(weight, (0, -cols % block, 0, -rows % block))
    tiles = tiles.reshape(tiles.shape[0] // block, block, tiles.shape[1] // block, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return (weight / full).to(torch.float8_e4m3fn), scale


def write_fp8_target(directory: Path, block: int = 16):
    """A tiny Qwen3 HF checkpoint (random, written here) with every linear FP8 block-scaled, and the HF model that
    holds exactly its dequantized values (the reference)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Qwen3Config

    from megatron_osprey.convert.safetensors_io import dequantize_fp8_blocks

    config = Qwen3Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(str(directory / "bf16"))
    tensors = load_file(str(directory / "bf16" / "model.safetensors"))
    quantized, state = {}, {}
    for name, tensor in tensors.items():
        if tensor.dim() != 2 or "embed" in name or "lm_head" in name:
            quantized[name] = state[name] = tensor
            continue
        q, scale = _quantize_fp8_blocks(tensor.float(), block)
        quantized[name], quantized[name + "_scale_inv"] = q, scale
        state[name] = dequantize_fp8_blocks(q, scale, (block, block))
    fp8 = directory / "fp8"
    fp8.mkdir()
    save_file(quantized, str(fp8 / "model.safetensors"))
    hf_config = json.loads((directory / "bf16" / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "weight_block_size": [block] * 2}
    (fp8 / "config.json").write_text(json.dumps(hf_config))
    model.load_state_dict(state, strict=False)
    return model, fp8


def check_target_path(sizes: Sizes, state) -> dict:
    """HF -> Megatron on the device from an FP8 block-scaled checkpoint (dequantized there), the online target's
    forward and layer capture, against the HF forward on the dequantized values."""
    from megatron_osprey.models.target.online import OnlineTarget

    on_gpu = state.device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    impl = "transformer_engine" if on_gpu else "local"
    aux_ids = (1, 2, 4)
    with tempfile.TemporaryDirectory() as tmp:
        hf, fp8_dir = write_fp8_target(Path(tmp))
        target = OnlineTarget(fp8_dir, state.config, state.device, aux_ids, params_dtype=dtype, transformer_impl=impl)
        devices = sorted({str(p.device) for p in target.stage.model.parameters()})
        ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(3))
        aux, final = target(ids.to(state.device))
        with torch.no_grad():
            hidden = hf(ids, output_hidden_states=True).hidden_states  # [embeddings, layer 0, ..., normed last]
            want_aux = torch.cat([hidden[i + 1] for i in aux_ids], dim=-1)
            want_final = hidden[-1]
            got_final = hf.model.norm(final.float().cpu())  # the capture is pre-norm; HF's last entry is normed
    aux_rel = float((aux.float().cpu() - want_aux).abs().max() / want_aux.abs().max())
    final_rel = float((got_final - want_final).abs().max() / want_final.abs().max())
    tolerance = 5e-2 if on_gpu else 1e-4  # bf16 weights and activations on the GPU, float32 on the CPU
    ok = aux_rel < tolerance and final_rel < tolerance and devices == [str(state.device)]
    return emit(
        "target_path",
        ok,
        transformer_impl=impl,
        dtype=str(dtype),
        fp8_block=16,
        parameter_devices=devices,
        aux_rel_diff=aux_rel,
        final_rel_diff=final_rel,
        tolerance=tolerance,
        **peak_fields(),
    )
