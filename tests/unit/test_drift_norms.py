"""Drafter options against attention drift: hidden_post_norm and aux_hidden_norm, Megatron = reference, and the
hidden-state norm per chain step with and without the post-norm."""

import dataclasses
import json

import pytest
import torch

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.models.drafter.arch import DrafterArch, eagle3_body
from megatron_osprey.models.drafter.config import DRAFTER_FLAGS, DistillDrafterConfig
from megatron_osprey.models.drafter.reference import ReferenceDrafter
from megatron_osprey.testing.tiny_models import qwen3_config

VOCAB = 96


def _arch(variant: str, post: bool, aux: bool) -> DrafterArch:
    target = ModelArch.from_hf_config(qwen3_config(layers=8, tie=False, vocab=VOCAB).to_dict())
    body = eagle3_body(target, 2) if variant == "eagle3" else dataclasses.replace(target, num_layers=2)
    return DrafterArch(
        body=body,
        target_hidden_size=target.hidden_size,
        vocab_size=VOCAB,
        draft_vocab_size=VOCAB if variant == "osprey" else 64,
        aux_layer_ids=(1, 3, 4),
        variant=variant,
        eagle3_extra_layers="fused",
        hidden_post_norm=post,
        aux_hidden_norm=aux,
    )


def _random_reference(arch: DrafterArch, seed: int = 0) -> ReferenceDrafter:
    torch.manual_seed(seed)
    drafter = ReferenceDrafter(arch.reference_config())
    with torch.no_grad():
        for param in drafter.parameters():  # norms off 1, so a norm dropped or swapped shows
            param.add_(0.05 * torch.randn_like(param))
    return drafter.eval()


def _inputs(arch: DrafterArch):
    ids = torch.randint(0, arch.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    aux = torch.randn(2, 10, 3 * arch.target_hidden_size, generator=torch.Generator().manual_seed(2))
    # Three taps of very different scales, as a target's low and high layers are: what aux_hidden_norm evens out.
    scale = torch.tensor([0.1, 1.0, 30.0]).repeat_interleave(arch.target_hidden_size)
    return ids, aux * scale


def test_flags_and_arch_carry_the_options_and_default_off():
    assert not DistillDrafterConfig().hidden_post_norm and not DistillDrafterConfig().aux_hidden_norm
    assert {"--hidden-post-norm", "--aux-hidden-norm"} <= {f.flag for f in DRAFTER_FLAGS}
    arch = _arch("osprey", False, False).with_drift_norms(
        DistillDrafterConfig(hidden_post_norm=True, aux_hidden_norm=True)
    )
    assert DrafterArch.from_dict(arch.to_dict()) == arch and arch.hidden_post_norm and arch.aux_hidden_norm
    old = {k: v for k, v in arch.to_dict().items() if k not in ("hidden_post_norm", "aux_hidden_norm")}
    assert not DrafterArch.from_dict(old).hidden_post_norm  # checkpoints saved before the options: off


@pytest.mark.parametrize("variant", ["osprey", "eagle3"])
def test_megatron_equals_reference_with_both_norms_and_they_change_the_output(variant):
    from megatron_osprey.models.drafter.convert import load_reference_state, reference_state
    from megatron_osprey.models.drafter.model import build_drafter_model
    from megatron_osprey.parallel import ParallelConfig, parallel_context

    arch = _arch(variant, post=True, aux=True)
    reference = _random_reference(arch)
    assert sorted(n for n, _ in reference.named_parameters() if n.startswith("fc_norm")) == [
        f"fc_norm.{i}.weight" for i in range(3)
    ]
    ids, aux = _inputs(arch)
    with torch.no_grad():
        expected = reference.ttt_forward(ids, aux, 3)
    with parallel_context(ParallelConfig()):
        model = build_drafter_model(arch, ParallelConfig()).eval()
        load_reference_state(model, reference.state_dict(), 0, 1)
        with torch.no_grad():
            got, _ = model.ttt_forward(ids, aux, 3)
        back = reference_state(model)
    for k in range(3):
        torch.testing.assert_close(got[k][..., : arch.draft_vocab_size], expected[k], atol=3e-5, rtol=0)
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(back[name], tensor, atol=0, rtol=0)
    # Each option changes what the drafter computes: aux_hidden_norm from step 0, hidden_post_norm from step 1.
    for post, aux_norm in ((True, False), (False, True), (False, False)):
        other = ReferenceDrafter(dataclasses.replace(reference.config, hidden_post_norm=post, aux_hidden_norm=aux_norm))
        other.load_state_dict(reference.state_dict(), strict=False)
        with torch.no_grad():
            logits = other.eval().ttt_forward(ids, aux, 3)
        assert not torch.allclose(logits[2], expected[2], atol=1e-3)
    only_post = ReferenceDrafter(dataclasses.replace(reference.config, aux_hidden_norm=False))
    only_post.load_state_dict(reference.state_dict(), strict=False)
    plain = ReferenceDrafter(dataclasses.replace(reference.config, hidden_post_norm=False, aux_hidden_norm=False))
    plain.load_state_dict(reference.state_dict(), strict=False)
    with torch.no_grad():
        a, b = only_post.eval().ttt_forward(ids, aux, 2), plain.eval().ttt_forward(ids, aux, 2)
    torch.testing.assert_close(a[0], b[0], atol=0, rtol=0)  # the post-norm acts between steps only
    assert not torch.allclose(a[1], b[1], atol=1e-3)


def _step_norms(drafter: ReferenceDrafter, ids, aux, steps: int) -> tuple[list[float], list[float]]:
    """Per TTT / chain step: mean L2 norm of the pre-norm hidden state, and of the state handed to the next step."""
    with torch.no_grad():
        _, hidden = drafter.ttt_forward(ids, aux, steps, return_hidden=True)
        passed = [drafter.passed_state(h) for h in hidden]
    mean_norm = lambda x: float(x.norm(dim=-1).mean())  # noqa: E731
    return [mean_norm(h) for h in hidden], [mean_norm(p) for p in passed]


def _with_post_norm(drafter: ReferenceDrafter) -> ReferenceDrafter:
    normed = ReferenceDrafter(dataclasses.replace(drafter.config, hidden_post_norm=True))
    normed.load_state_dict(drafter.state_dict())
    return normed.eval()


def test_hidden_state_norm_per_chain_step_grows_without_the_post_norm_and_not_with_it():
    arch = _arch("eagle3", post=False, aux=False)  # EAGLE-3: the state handed on is the residual stream itself
    drafter = _random_reference(arch, seed=3)
    ids, aux = _inputs(arch)
    without, _ = _step_norms(drafter, ids, aux, 6)
    normed = _with_post_norm(drafter)
    with_post, passed = _step_norms(normed, ids, aux, 6)
    print("EAGLE-3 hidden norm per step, without post-norm:", [f"{n:.2f}" for n in without])
    print("EAGLE-3 hidden norm per step, with post-norm:   ", [f"{n:.2f}" for n in with_post])
    assert all(b > a for a, b in zip(without, without[1:]))  # the residual path accumulates with depth
    assert with_post[0] == without[0]  # step 0 reads the target's features either way
    # With the post-norm each step hands on norm(h), whose size the final norm's weight sets, whatever the depth.
    bound = float(normed.norm.weight.detach().abs().max()) * arch.hidden_size**0.5
    assert all(p <= bound * (1 + 1e-5) for p in passed)
    assert all(w < 0.2 * n for w, n in zip(with_post[1:], without[1:]))


def test_osprey_reads_its_state_through_hidden_norm_so_the_post_norm_barely_moves_its_hidden_norms():
    # Osprey's residual stream starts from the token embedding and g enters only through hidden_norm (an
    # RMSNorm): g's magnitude never reaches the stream, so the post-norm changes only g's per-channel scale.
    arch = _arch("osprey", post=False, aux=False)
    drafter = _random_reference(arch, seed=3)
    ids, aux = _inputs(arch)
    without, _ = _step_norms(drafter, ids, aux, 6)
    with_post, _ = _step_norms(_with_post_norm(drafter), ids, aux, 6)
    pairs = [f"{a:.2f}/{b:.2f}" for a, b in zip(without, with_post)]
    print("Osprey hidden norm per step, without / with post-norm:", pairs)
    assert max(without) < 1.2 * min(without)
    assert all(abs(a - b) < 0.02 * a for a, b in zip(without, with_post))


def test_one_layer_eagle3_with_both_norms_exports_to_stock_sglang_flags_and_reads_back(tmp_path):
    from safetensors.torch import load_file

    from megatron_osprey.export.formats import export_drafter, read_export
    from tests.sglang_stock import stock_load

    target = ModelArch.from_hf_config(qwen3_config(layers=8, tie=False, vocab=VOCAB).to_dict())
    arch = dataclasses.replace(_arch("eagle3", post=True, aux=True), body=eagle3_body(target, 1))
    drafter = _random_reference(arch)
    export_drafter(drafter, "sglang", tmp_path / "s")
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["fc_norm"] is True
    assert config["norm_output"] is True
    loaded = stock_load(tmp_path / "s")  # sglang 0.5.23 builds fc_norm.{0,1,2} from the fc_norm flag
    assert loaded.skipped == [] and loaded.missing == [] and "model.fc_norm.2.weight" in loaded.loaded
    back = read_export(tmp_path / "s")
    assert back.config == drafter.config
    # SGLang's semantics on the exported tensors: each aux chunk RMS-normed by fc_norm.i, then fc; the state
    # handed to the next draft step is norm(h) under norm_output.
    tensors = load_file(str(tmp_path / "s" / "model.safetensors"))
    ids, aux = _inputs(arch)
    eps = config["rms_norm_eps"]
    rms = lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))  # noqa: E731
    chunks = aux.chunk(3, dim=-1)
    fused = torch.cat([rms(c, tensors[f"fc_norm.{i}.weight"]) for i, c in enumerate(chunks)], -1)
    with torch.no_grad():
        torch.testing.assert_close(drafter.fuse(aux), fused @ tensors["fc.weight"].T, atol=1e-5, rtol=1e-5)
        _, state = drafter(ids, aux_hidden=aux)
        _, hidden = drafter.ttt_forward(ids, aux, 1, return_hidden=True)
    torch.testing.assert_close(state, rms(hidden[0], tensors["norm.weight"]), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="--format speculators"):
        export_drafter(drafter, "speculators", tmp_path / "spec")


def test_distill_from_stage3_trains_both_options_and_the_checkpoint_serves_them(tmp_path):
    # Stage 3's checkpoint has no fc_norm: distill starts those norms at ones, trains them, saves both options.
    from megatron_osprey.eval.loading import load_megatron_drafter
    from megatron_osprey.parallel import parallel_context
    from megatron_osprey.testing.distill_setup import build_distill_setup, tiny_distill_config
    from megatron_osprey.training.distillation import run_distill

    setup = build_distill_setup(tmp_path / "setup")
    cfg = tiny_distill_config(
        setup,
        training__train_iters=3,
        drafter__hidden_post_norm=True,
        drafter__aux_hidden_norm=True,
        checkpoint__save=str(tmp_path / "ckpt"),
    )
    with parallel_context(cfg.parallel) as state:
        result = run_distill(cfg, state)
    assert result.arch.hidden_post_norm and result.arch.aux_hidden_norm
    loaded = load_megatron_drafter(tmp_path / "ckpt")
    assert loaded.drafter.config.hidden_post_norm and loaded.drafter.config.aux_hidden_norm
    weights = torch.stack([norm.weight for norm in loaded.drafter.fc_norm])
    assert weights.shape == (3, loaded.drafter.config.target_hidden_size)
    assert not torch.equal(weights, torch.ones_like(weights))  # moved off their init: trained, and saved
