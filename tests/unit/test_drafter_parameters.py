"""`osprey plan`'s drafter parameter count is the built model's: every drafter family at tiny size (tied and untied
backbones, reduced draft vocabulary, padded tables), and every distill recipe's drafter built on the meta device."""

import pytest
import torch

from launcher.plan import planned_drafter
from megatron_osprey.base.arch import ModelArch
from megatron_osprey.models.drafter.model import DrafterArch, build_drafter_model, eagle3_body
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.recipes import RECIPES, get_recipe
from megatron_osprey.testing.tiny_models import llama_config, qwen3_config

VOCAB = 300  # padded to 384: the tables' padding is counted
TARGET = ModelArch.from_hf_config(llama_config(layers=6, vocab=VOCAB))


def _built(arch: DrafterArch, device: str = "cpu") -> tuple[int, int]:
    """(trainable, frozen) parameters of the drafter build_drafter_model builds at TP 1."""
    with parallel_context(ParallelConfig()) as state, torch.device(device):
        model = build_drafter_model(arch, state.config, transformer_impl="local", perform_initialization=False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters() if not p.requires_grad)


def _osprey(body_config, **changes) -> DrafterArch:
    body = ModelArch.from_hf_config(body_config).with_num_layers(2)
    fields = dict(body=body, target_hidden_size=TARGET.hidden_size, vocab_size=VOCAB, draft_vocab_size=VOCAB)
    return DrafterArch(aux_layer_ids=(1, 2, 3), **(fields | changes))


def _eagle3(layers: int, extra: str = "fused") -> DrafterArch:
    return DrafterArch(
        body=eagle3_body(TARGET, layers),
        target_hidden_size=TARGET.hidden_size,
        vocab_size=VOCAB,
        draft_vocab_size=200,
        aux_layer_ids=(1, 2, 3),
        variant="eagle3",
        eagle3_extra_layers=extra,
    )


FAMILIES = {
    "osprey_tied_qwen3_backbone": lambda: _osprey(qwen3_config(tie=True, vocab=VOCAB)),
    "osprey_untied_llama_backbone": lambda: _osprey(llama_config(tie=False, vocab=VOCAB)),
    "osprey_draft_vocab": lambda: _osprey(qwen3_config(tie=True, vocab=VOCAB), draft_vocab_size=200),
    "osprey_aux_hidden_norm": lambda: _osprey(qwen3_config(tie=True, vocab=VOCAB), aux_hidden_norm=True),
    "eagle3_1layer": lambda: _eagle3(1),
    "eagle3_2layer_fused": lambda: _eagle3(2),
    "eagle3_2layer_plain": lambda: _eagle3(2, "plain"),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_counted_parameters_are_the_built_models(family):
    arch = FAMILIES[family]()
    assert arch.num_parameters() == _built(arch)


def test_a_tied_backbone_still_gets_its_own_output_layer():
    tied, untied = _osprey(qwen3_config(tie=True, vocab=VOCAB)), _osprey(qwen3_config(tie=False, vocab=VOCAB))
    assert arch_count(tied) == arch_count(untied)  # the drafter's output layer is never tied to its embedding


def arch_count(arch: DrafterArch) -> int:
    return arch.num_parameters()[0]


DISTILL_RECIPES = sorted(
    name for name in RECIPES if get_recipe(name).distill is not None and get_recipe(name).hardware != "cpu"
)


@pytest.mark.parametrize("name", DISTILL_RECIPES)
def test_the_plans_drafter_is_the_one_built_on_the_meta_device(name, monkeypatch):
    """The plan's (trainable, frozen) for the recipe's full-size drafter equal a meta-device build's."""
    # The rotary frequencies are copied to the rotary module's (CPU) buffer: a meta tensor has nothing to copy.
    monkeypatch.setattr(
        "megatron_osprey.models.drafter.model.rotary_inv_freq",
        lambda body: torch.zeros(body.head_dim // 2, device="cpu"),
    )
    recipe = get_recipe(name)
    plan_arch, trainable, frozen = planned_drafter(recipe, recipe.config("distill"))
    assert (trainable, frozen) == _built(plan_arch, "meta")


def test_the_drafter_swaps_mlp_linears_in_either_form_of_megatrons_mlp_spec():
    # megatron-core 0.16 gives a dense MLP as a ModuleSpec, 0.17 and later as partial(MLP.as_mlp_submodule, ...).
    import dataclasses
    import functools

    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_osprey.models.backbone.specs import replace_spec_submodules, spec_submodules

    original = MLPSubmodules(linear_fc1="fc1", linear_fc2="fc2")
    for spec in (ModuleSpec(module=MLP, submodules=original), functools.partial(MLP, submodules=original)):
        swapped = replace_spec_submodules(spec, linear_fc1="drafter_fc1")
        assert type(swapped) is type(spec) and getattr(swapped, "module", getattr(swapped, "func", None)) is MLP
        assert spec_submodules(swapped) == dataclasses.replace(original, linear_fc1="drafter_fc1")
        assert spec_submodules(spec) is original  # the backbone's spec is left as it was
