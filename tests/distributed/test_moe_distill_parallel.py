"""The dense drafter distilled on a mixture-of-experts target in a job laid out with expert parallelism (the
MiniMax recipes set EP for the whole job): built at EP 1 inside that layout and replicated over the EP ranks,
it takes the same updates at EP=2 as at EP=1 (DP=2), online and in Draft-OPD's on-policy step (torchrun, gloo)."""

import pytest

from megatron_osprey.stages import adapt
from megatron_osprey.stages.adapt import AdaptConfig
from megatron_osprey.stages.rollout import run
from megatron_osprey.testing.distill_setup import build_distill_setup
from megatron_osprey.testing.tiny_models import write_chat_target
from tests.distributed.launch import run_torchrun
from tests.distributed.scripts.check_rollout import rollout_config

pytestmark = pytest.mark.distributed
KEYS = ("loss/train", "optim/grad_norm", "acc/0")


@pytest.fixture(scope="module")
def moe_setup(tmp_path_factory):
    """A random Qwen3-MoE target (8 experts, top 2) and the pruned backbone adapted to it."""
    setup = build_distill_setup(tmp_path_factory.mktemp("moe_distill_setup"))
    root = setup["root"]
    write_chat_target(root / "moe", "qwen3_moe")
    adapt.run(
        AdaptConfig(
            backbone=str(root / "backbone"),
            target=str(root / "moe"),
            output=str(root / "moe_drafter"),
            aux_layer_ids=[1, 3, 4],
        )
    )
    return setup


@pytest.fixture(scope="module")
def online(moe_setup, tmp_path_factory):
    root = moe_setup["root"]
    extra = ["online", str(root / "moe"), str(root / "moe_drafter"), str(moe_setup["data"])]
    return run_torchrun("check_moe_distill.py", tmp_path_factory.mktemp("moe_online"), timeout=400, extra=extra)


@pytest.fixture(scope="module")
def on_policy(moe_setup, online, tmp_path_factory):
    """Draft-OPD: the single-process HF rollout of the online EP=2 run's drafter, then the on-policy step."""
    root = moe_setup["root"]
    sft = online["ep2"]["save"]
    run(rollout_config(str(root / "moe"), sft, str(moe_setup["data"]), root / "moe_rollout"))
    extra = ["on-policy", str(root / "moe"), sft, str(moe_setup["data"]), str(root / "moe_rollout")]
    return run_torchrun("check_moe_distill.py", tmp_path_factory.mktemp("moe_opd"), timeout=400, extra=extra)


def _compare(figures: dict) -> None:
    ep2, dp2 = figures["ep2"], figures["dp2"]
    assert len(ep2["loss/train"]) == len(dp2["loss/train"]) == 2
    assert all(loss > 0 for loss in ep2["loss/train"])
    for key in KEYS:
        for a, b in zip(ep2[key], dp2[key]):
            # The same float32 arithmetic on the same ranks' data: measured 0 difference.
            assert abs(a - b) <= 1e-6 * max(1.0, abs(b)), (key, ep2[key], dp2[key])


def test_online_distill_at_ep2_equals_dp2(online):
    _compare(online)


def test_on_policy_step_at_ep2_equals_dp2(on_policy):
    _compare(on_policy)
