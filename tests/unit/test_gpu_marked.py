"""The GPU-only paths: Transformer Engine spec against the local spec, an FP8 step, device placement,
importance pruning. Marked `gpu`; skipped where CUDA (or the extra they need) is absent.

The tolerances below are not measured on a GPU yet (the session that wrote them had none): each
comment says what it allows for. Tighten them to ~10x the measured error once they have run.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_osprey.testing.tiny_models import VOCAB, qwen3_config, write_chat_target

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def parallel():
    from megatron_osprey.parallel import ParallelConfig, parallel_context

    with parallel_context(ParallelConfig()) as state:
        yield state


def hf_and_ids(tmp_path):
    from megatron_osprey.testing.tiny_models import make_hf_model

    hf = make_hf_model(qwen3_config(tie=False), tmp_path / "hf").eval()
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    return tmp_path / "hf", ids, expected


def megatron_logits(hf_dir, ids, parallel, transformer_impl: str) -> torch.Tensor:
    from megatron_osprey.base.arch import ModelArch
    from megatron_osprey.convert.hf_to_megatron import load_hf_weights
    from megatron_osprey.models.backbone.gpt import build_gpt_model
    from megatron_osprey.testing.tiny_models import causal_logits

    arch = ModelArch.from_hf_config(hf_dir)
    model = build_gpt_model(
        arch, parallel.config, transformer_impl=transformer_impl, perform_initialization=False
    ).eval()
    assert model.transformer_impl == transformer_impl
    load_hf_weights(model, hf_dir, arch, tp_rank=0, tp_size=1)
    model.cuda()
    with torch.no_grad():
        return causal_logits(model, ids.cuda())[..., :VOCAB].float().cpu()


def test_device_placement_on_cuda(tmp_path, parallel):
    from megatron_osprey.parallel import cpu_compat

    assert parallel.device.type == "cuda"
    assert not cpu_compat.is_active()  # the CPU layer stays off where CUDA exists
    hf_dir, ids, expected = hf_and_ids(tmp_path)
    from megatron_osprey.base.arch import ModelArch
    from megatron_osprey.convert.hf_to_megatron import load_hf_weights
    from megatron_osprey.models.backbone.gpt import build_gpt_model
    from megatron_osprey.testing.tiny_models import causal_logits

    arch = ModelArch.from_hf_config(hf_dir)
    model = build_gpt_model(arch, parallel.config, transformer_impl="local", perform_initialization=False).eval()
    load_hf_weights(model, hf_dir, arch, tp_rank=0, tp_size=1)
    model.cuda()
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    with torch.no_grad():
        logits = causal_logits(model, ids.cuda())
    assert logits.device.type == "cuda"
    # float32 on the GPU (TF32 off by default in torch matmuls); 1e-7-scale on CPU.
    assert (logits[..., :VOCAB].float().cpu() - expected).abs().max().item() < 1e-4


def test_transformer_engine_spec_equals_local_spec_and_hf(tmp_path, parallel):
    pytest.importorskip("transformer_engine", reason="needs Transformer Engine (pip install -e '.[gpu]')")
    hf_dir, ids, expected = hf_and_ids(tmp_path)
    local = megatron_logits(hf_dir, ids, parallel, "local")
    te = megatron_logits(hf_dir, ids, parallel, "transformer_engine")
    te_error, local_error = (te - expected).abs().max().item(), (local - expected).abs().max().item()
    print(f"TE vs HF {te_error:.2e}, local vs HF {local_error:.2e}, TE vs local {(te - local).abs().max().item():.2e}")
    # Fused kernels reorder float32 sums; a wrong weight mapping (fused norm, QKV layout) is O(0.1).
    assert te_error < 1e-3 and local_error < 1e-4


def test_fp8_training_step(tmp_path, parallel):
    pytest.importorskip("transformer_engine", reason="FP8 needs Transformer Engine")
    from megatron_osprey.recipes import get_recipe
    from megatron_osprey.training.pretraining import run_pretrain
    from tests.distributed.scripts.check_pretrain_fixtures import make_backbone, make_corpus

    make_corpus(tmp_path / "data" / "corpus_text_document")
    make_backbone(tmp_path)

    def first_losses(fp8: str | None) -> list[float]:
        cfg = get_recipe("tiny_cpu_backbone_pretrain_2proc_fp32").pretrain
        cfg.model.backbone = str(tmp_path / "backbone")
        cfg.model.transformer_impl, cfg.model.bf16, cfg.model.fp8_format = "transformer_engine", True, fp8
        cfg.data.data_path = [str(tmp_path / "data" / "corpus_text_document")]
        cfg.training.train_iters, cfg.logging.eval_iters, cfg.logging.progress_bar = 3, 0, False
        result = run_pretrain(cfg, parallel)
        return [h["loss/train"] for h in result.history if "loss/train" in h]

    bf16, fp8 = first_losses(None), first_losses("hybrid")
    print(f"bf16 losses {bf16}, fp8 losses {fp8}")
    assert len(fp8) == 3 and all(math.isfinite(x) for x in fp8)
    # Step 1 is the same model and batch: FP8 (e4m3 forward) moves a ~5.7 loss by quantization only.
    assert abs(fp8[0] - bf16[0]) < 0.05


def test_importance_pruning_drops_the_layers_that_do_nothing(tmp_path, parallel):
    pytest.importorskip("modelopt.torch.prune", reason="--strategy importance needs nvidia-modelopt")
    from safetensors.torch import load_file

    from megatron_osprey.convert.megatron_to_hf import export_to_hf
    from megatron_osprey.models.backbone.prune import prune_backbone
    from megatron_osprey.stages.prune import PruneConfig

    source = tmp_path / "source"
    hf = write_chat_target(source, "qwen3")  # 6 layers, with a tokenizer for the calibration text
    # Layers 1-4 write nothing to the residual stream: their outputs equal their inputs, so they
    # are the least important and Minitron must keep layers 0 and 5.
    with torch.no_grad():
        for layer in hf.model.layers[1:5]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    hf.save_pretrained(source)
    calibration = tmp_path / "calibration.jsonl"
    calibration.write_text(
        "".join(json.dumps({"text": f"the cat sat on mat number {i} and ran"}) + "\n" for i in range(8))
    )
    # The library's pruning in this module's process groups (the stage's run() would set up its own),
    # then the HF export the stage writes as OUT/hf.
    result = prune_backbone(
        PruneConfig(
            source=str(source),
            output=str(tmp_path / "out"),
            num_layers=2,
            strategy="importance",
            calibration_data=str(calibration),
        ),
        parallel,
    )
    export_to_hf(result.models, result.arch, tmp_path / "out" / "hf")
    assert result.kept_layers == [0, 5]
    original = load_file(source / "model.safetensors")
    pruned = load_file(tmp_path / "out" / "hf" / "model.safetensors")
    for new, old in enumerate(result.kept_layers):
        for name, tensor in pruned.items():
            if name.startswith(f"model.layers.{new}."):
                assert torch.equal(tensor, original[name.replace(f"layers.{new}.", f"layers.{old}.")]), name


def test_sampling_draws_on_the_cpu_generator_whatever_the_logits_device():
    """Sampled decoding (evaluate --temperature, sampled rollouts) with a GPU target: the engine's generator is a
    CPU one, so every draw happens there, and the same seed draws the same tokens as on the CPU."""
    from megatron_osprey.speculative.generate import _pick
    from megatron_osprey.speculative.tree import DraftTree
    from megatron_osprey.speculative.verify import accept_sampling

    rng = torch.Generator().manual_seed(0)
    logits, target = 3 * torch.randn(64, generator=rng), 3 * torch.randn(3, 64, generator=rng)
    proposals = [torch.softmax(3 * torch.randn(64, generator=rng).double(), -1) for _ in range(2)]
    for seed in range(8):
        assert _pick(logits.cuda(), 1.0, torch.Generator().manual_seed(seed)) == _pick(
            logits, 1.0, torch.Generator().manual_seed(seed)
        )
        outcomes = []
        for device in ("cpu", "cuda"):
            tree = DraftTree()
            tree.add(int(proposals[0].argmax()), -1, proposals[0].to(device))
            tree.add(int(proposals[1].argmax()), 0, proposals[1].to(device))
            outcomes.append(accept_sampling(tree, target.to(device), 1.0, torch.Generator().manual_seed(seed)))
        assert outcomes[0] == outcomes[1]
