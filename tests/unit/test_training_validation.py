"""Training flags that cannot train are refused up front, naming the flag."""

import math

import pytest


@pytest.mark.parametrize(
    "section, field, value, message",
    [
        ("optimizer", "clip_grad", -1.0, r"--clip-grad must be >= 0 \(0 turns clipping off\), got -1.0"),
        ("optimizer", "lr", math.inf, r"--lr must be a finite number > 0, got inf"),
        ("optimizer", "lr", 0.0, r"--lr must be a finite number > 0, got 0.0"),
        ("optimizer", "lr", math.nan, r"--lr must be a finite number > 0, got nan"),
        ("optimizer", "min_lr", -1e-5, r"--min-lr must be a finite number >= 0"),
        ("training", "train_iters", 0, r"--train-iters must be >= 1 \(the run's length\), got 0"),
    ],
)
def test_values_that_cannot_train_are_refused_naming_the_flag(section, field, value, message):
    from megatron_osprey.parallel import ParallelConfig
    from megatron_osprey.training.config import OptimizerConfig, TrainingConfig, validate_optimizer, validate_training

    training, optimizer = TrainingConfig(train_iters=10), OptimizerConfig()
    setattr(training if section == "training" else optimizer, field, value)
    with pytest.raises(ValueError, match=message):
        validate_training(training, ParallelConfig(), 1)
        validate_optimizer(optimizer, training)
    assert OptimizerConfig(clip_grad=0.0).clip_grad == 0.0  # 0 (off) stays accepted
    validate_optimizer(OptimizerConfig(clip_grad=0.0), TrainingConfig(train_iters=10))
