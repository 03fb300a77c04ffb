"""One `--set` implementation: the entry points and the launcher read and check values alike."""

import pytest

from megatron_osprey.recipes import resolve_recipe
from megatron_osprey.stages.distill import config_from_args as distill_config_and_invocation
from megatron_osprey.stages.pretrain import config_from_args as pretrain_config_and_invocation


def config_from_args(argv):
    return pretrain_config_and_invocation(argv)[0]


def distill_config_from_args(argv):
    return distill_config_and_invocation(argv)[0]


def test_entry_points_and_launcher_read_a_value_the_same_way():
    pretrain = config_from_args(["--set", "optimizer.lr=2e-4", "--set", "training.train_iters=7"])
    distill = distill_config_from_args(["--set", "optimizer.lr=2e-4"])
    recipe = resolve_recipe(
        "tiny_cpu_backbone_pretrain_2proc_fp32", ["pretrain.optimizer.lr=2e-4", "pretrain.training.train_iters=7"]
    ).pretrain
    assert pretrain.optimizer.lr == distill.optimizer.lr == recipe.optimizer.lr == 2e-4
    assert (
        isinstance(pretrain.optimizer.lr, float) and pretrain.training.train_iters == recipe.training.train_iters == 7
    )


@pytest.mark.parametrize(
    "argv", [["--set", "training.train_iters=ten"], ["--set", "optimizer.use_distributed_optimizer=1"]]
)
def test_a_mistyped_value_is_refused_by_the_entry_point_as_by_the_launcher(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:  # the entry point: argparse's one line, exit 2
        config_from_args(argv)
    assert exit_info.value.code == 2 and "expected" in capsys.readouterr().err
    with pytest.raises(ValueError, match="expected an integer"):
        resolve_recipe("tiny_cpu_backbone_pretrain_2proc_fp32", ["pretrain.training.train_iters=ten"])
