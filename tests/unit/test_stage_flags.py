"""Every flag a stage accepts it honours, or refuses by name."""

import pytest

from megatron_osprey.stages.distill import config_from_args
from megatron_osprey.training.checkpointing import resume_iteration


def distill_config_from_args(argv):
    return config_from_args(argv)[0]


@pytest.mark.parametrize("flag", ["--eval-interval", "--eval-iters"])
def test_distill_refuses_the_validation_flags_it_has_no_use_for(flag, capsys):
    with pytest.raises(SystemExit):
        distill_config_from_args([flag, "5"])
    assert flag in capsys.readouterr().err


def test_distill_resumes_from_ckpt_step_like_pretraining(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("40")
    assert resume_iteration(distill_config_from_args(["--load", str(tmp_path)]).checkpoint) == 40
    assert resume_iteration(distill_config_from_args(["--load", str(tmp_path), "--ckpt-step", "20"]).checkpoint) == 20
    assert resume_iteration(distill_config_from_args([]).checkpoint) is None
