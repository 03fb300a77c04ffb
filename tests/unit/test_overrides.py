"""One `--set` implementation: the entry points and the launcher read and check values alike."""

import pytest

from megatron_osprey.config.args import config_from_args
from megatron_osprey.config.distill_args import distill_config_from_args
from megatron_osprey.config.recipes import resolve_recipe


def test_entry_points_and_launcher_read_a_value_the_same_way():
    pretrain = config_from_args(["--set", "optimizer.lr=2e-4", "--set", "training.train_iters=7"])
    distill = distill_config_from_args(["--set", "optimizer.lr=2e-4"])
    recipe = resolve_recipe("tiny_cpu_backbone_pretrain_2proc_fp32", ["training.lr=2e-4", "training.train_iters=7"])
    assert pretrain.optimizer.lr == distill.optimizer.lr == recipe.training.lr == 2e-4
    assert (
        isinstance(pretrain.optimizer.lr, float) and pretrain.training.train_iters == recipe.training.train_iters == 7
    )


@pytest.mark.parametrize(
    "argv", [["--set", "training.train_iters=ten"], ["--set", "optimizer.use_distributed_optimizer=1"]]
)
def test_a_mistyped_value_is_refused_by_the_entry_point_as_by_the_launcher(argv):
    with pytest.raises(ValueError, match="expected"):
        config_from_args(argv)
    with pytest.raises(ValueError, match="expected an integer"):
        resolve_recipe("tiny_cpu_backbone_pretrain_2proc_fp32", ["training.train_iters=ten"])
