"""TTT loss, metrics and gradients at TP=2 (± sequence parallel) equal TP=1 (torchrun, gloo)."""

import pytest

from tests.distributed.launch import run_torchrun

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    return run_torchrun("check_ttt.py", tmp_path_factory.mktemp("ttt"))


@pytest.mark.parametrize("vocab", [200, 300], ids=["reduced_draft_vocab", "full_vocab"])
@pytest.mark.parametrize("layout", ["tp2", "tp2_sp"])
def test_tp2_equals_tp1(figures, vocab, layout):
    key = f"v{vocab}_{layout}"
    assert figures[f"{key}_loss"] > 0
    assert figures[f"{key}_loss_diff"] < 1e-5
    assert figures[f"{key}_metric_diff"] < 1e-5
    assert figures[f"{key}_fc_grad_diff"] < 1e-6
