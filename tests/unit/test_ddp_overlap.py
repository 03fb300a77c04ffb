"""--overlap-grad-reduce / --overlap-param-gather: on in the 64-GPU pretraining recipes when CUDA is there, off on
the CPU (gloo), refused where Megatron-Core cannot run them, and wired into the schedules as Megatron-LM does."""

from __future__ import annotations

import pytest
import torch

from megatron_osprey.recipes import RECIPES, get_recipe
from megatron_osprey.training.config import OptimizerConfig, TrainingConfig, validate_optimizer
from megatron_osprey.training.setup import overlap_settings

PRETRAIN = [name for name in RECIPES if "backbone_pretrain" in name and "64gpu" in name]


def test_pretraining_recipes_overlap_on_a_gpu_and_not_on_the_cpu():
    assert len(PRETRAIN) >= 4
    for name in PRETRAIN:
        optimizer = get_recipe(name).pretrain.optimizer
        assert optimizer.use_distributed_optimizer, name
        assert overlap_settings(optimizer, on_gpu=True) == (True, True), name
        assert overlap_settings(optimizer, on_gpu=False) == (False, False), name


def test_the_default_and_the_distillation_recipes_do_not_overlap():
    assert overlap_settings(OptimizerConfig(use_distributed_optimizer=True), on_gpu=True) == (False, False)
    distill = get_recipe("qwen3_8b_osprey_distill_2gpu_h100_bf16").distill.optimizer
    assert overlap_settings(distill, on_gpu=True) == (False, False)


@pytest.mark.parametrize(
    "settings",
    [
        dict(overlap_param_gather=True, overlap_grad_reduce=True),  # no distributed optimizer
        dict(overlap_param_gather=True, use_distributed_optimizer=True),  # no grad-reduce overlap
    ],
)
def test_param_gather_overlap_without_what_it_needs_is_refused(settings):
    with pytest.raises(ValueError, match="--overlap-param-gather needs --use-distributed-optimizer and"):
        validate_optimizer(OptimizerConfig(**settings), TrainingConfig(train_iters=10))


def _train(overlap: bool, steps: int = 3):
    """Steps of a tiny GPT under the distributed optimizer (one rank), overlap on or off; losses, weights, config."""
    from megatron.core.utils import get_model_config

    from megatron_osprey.base.arch import ModelArch
    from megatron_osprey.models.backbone.gpt import build_gpt_model
    from megatron_osprey.parallel import ParallelConfig, parallel_context
    from megatron_osprey.testing.tiny_models import qwen3_config
    from megatron_osprey.training import loop, setup
    from megatron_osprey.training.config import CheckpointConfig, LoggingConfig
    from megatron_osprey.training.gpt_step import gpt_forward_step

    arch = ModelArch.from_hf_config(qwen3_config(layers=2).to_dict())
    section = OptimizerConfig(
        lr=1e-2, use_distributed_optimizer=True, overlap_grad_reduce=overlap, overlap_param_gather=overlap
    )
    training = TrainingConfig(micro_batch_size=2, global_batch_size=4, seq_length=16, train_iters=steps)
    with parallel_context(ParallelConfig()) as state:
        torch.manual_seed(0)
        model = setup.build_model_chunks(
            lambda **kw: build_gpt_model(arch, state.config, transformer_impl="local", **kw),
            state.config,
            bf16=False,
            use_distributed_optimizer=True,
            overlap_grad_reduce=overlap,
            overlap_param_gather=overlap,
        )
        optimizer, scheduler = setup.build_optimizer_and_scheduler(model, section, bf16=False, train_iters=steps)
        run = loop.TrainRun(model, optimizer, scheduler, training, CheckpointConfig(), LoggingConfig(), None, None, 1,
                            torch.device("cpu"))  # fmt: skip
        generator = torch.Generator().manual_seed(1)

        def batches():
            while True:
                tokens = torch.randint(0, arch.vocab_size, (2, 16), generator=generator)
                yield {
                    "tokens": tokens,
                    "position_ids": torch.arange(16).expand(2, 16),
                    "labels": torch.roll(tokens, -1, 1),
                    "loss_mask": torch.ones(2, 16),
                }

        data = batches()
        losses = [loop.train_step(gpt_forward_step, data, run).loss for _ in range(steps)]
        loop.gather_params(model)
        weights = {k: v.detach().clone() for k, v in model[0].module.state_dict().items() if torch.is_tensor(v)}
        config = get_model_config(model[0])
        wiring = (config.no_sync_func, config.grad_sync_func, model[0])
    return losses, weights, wiring


def test_overlap_is_wired_into_the_schedules_and_trains_as_without_it():
    plain_losses, plain_weights, (no_sync, grad_sync, _) = _train(overlap=False)
    assert no_sync is None and grad_sync is None
    losses, weights, (no_sync, grad_sync, chunk) = _train(overlap=True)
    # Megatron-LM's wiring: the schedules hold the grad sync back until the last micro-batch.
    assert no_sync == chunk.no_sync and grad_sync == chunk.start_grad_sync
    assert chunk.ddp_config.overlap_grad_reduce and chunk.ddp_config.overlap_param_gather
    assert losses == plain_losses and plain_losses[-1] < plain_losses[0]
    assert weights.keys() == plain_weights.keys()
    assert all(torch.equal(weights[k], plain_weights[k]) for k in weights)
