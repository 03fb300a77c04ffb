"""A drafter meets the target it was adapted to: distill refuses another vocabulary; eval warns on another target."""

from types import SimpleNamespace

import pytest

from megatron_osprey.eval.checks import recorded_target_warning
from megatron_osprey.training.distillation import check_drafter_matches_target


def test_distill_refuses_a_drafter_whose_vocabulary_is_not_the_targets():
    cfg = SimpleNamespace(drafter=SimpleNamespace(drafter_init="INIT"), target=SimpleNamespace(path="T"))
    target = SimpleNamespace(vocab_size=400, hidden_size=64)
    with pytest.raises(ValueError, match=r"--drafter-init INIT: its vocabulary \(512\) is not --target T's \(400\)"):
        check_drafter_matches_target(cfg, SimpleNamespace(vocab_size=512, target_hidden_size=64), target)
    with pytest.raises(ValueError, match=r"hidden states of size 32, but --target T has hidden_size 64"):
        check_drafter_matches_target(cfg, SimpleNamespace(vocab_size=400, target_hidden_size=32), target)
    check_drafter_matches_target(cfg, SimpleNamespace(vocab_size=400, target_hidden_size=64), target)


def test_eval_warns_naming_both_targets_when_the_recorded_one_differs(tmp_path):
    trained, other, copy = tmp_path / "qwen", tmp_path / "qwen-ft", tmp_path / "qwen-copy"
    for directory, text in ((trained, "a"), (other, "b"), (copy, "a")):
        directory.mkdir()
        (directory / "config.json").write_text(text)
    warning = recorded_target_warning(tmp_path / "d", {"target": str(trained)}, other)
    assert warning.startswith(
        f"--drafter {tmp_path / 'd'} was trained against target {trained}, but --target is {other}"
    )
    assert recorded_target_warning(tmp_path / "d", {"target": str(trained)}, copy) is None  # same files
    assert recorded_target_warning(tmp_path / "d", {"target": str(trained)}, trained) is None
    assert recorded_target_warning(tmp_path / "d", {}, other) is None  # nothing recorded
