"""The adapted Osprey drafter at TP=2 and TP=2 + sequence parallel (torchrun, gloo)."""

import pytest

from tests.distributed.launch import run_torchrun

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def figures(tmp_path_factory, adapted_drafter):
    return run_torchrun("check_drafter.py", tmp_path_factory.mktemp("drafter"), extra=[str(adapted_drafter["drafter"])])


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp"])
def test_ttt_logits_equal_reference(figures, layout):
    assert figures[f"{layout}_ttt_max_abs"] < 1e-5


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp"])
def test_gathered_state_is_the_reference_state(figures, layout):
    assert figures[f"{layout}_reference_state_identical"] is True


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp"])
def test_w_new_gets_gradients_on_every_rank(figures, layout):
    assert figures[f"{layout}_w_new_grad_on_all_ranks"] is True
