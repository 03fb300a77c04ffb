"""Draft-OPD under torchrun (gloo). The rollout on the Megatron-Core target at TP=2 and at DP=2, and on a
mixture-of-experts target at TP=2 + SP, TP=2 + SP + EP=2 and EP=2, equals the single-process HF rollout: the same
tokens, rounds, replays and accepted counts, the same target distributions; a sampled rollout (temperature 1)
at DP=2 draws what the single-process one draws. On-policy distillation on that store
at TP=2, TP=2 + SP and DP=2 takes the single-process run's updates: the same losses and gradient norms; and so does
the online form (the authors' loop) at DP=2, each rank rolling out its half of every round."""

import pytest

from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.stages import adapt
from megatron_osprey.stages.adapt import AdaptConfig
from megatron_osprey.stages.rollout import run
from megatron_osprey.testing.distill_setup import build_distill_setup, tiny_distill_config
from megatron_osprey.testing.tiny_models import write_chat_target
from megatron_osprey.training.distillation import run_distill
from tests.distributed.launch import run_torchrun
from tests.distributed.scripts.check_on_policy import LAYOUTS as ON_POLICY_LAYOUTS
from tests.distributed.scripts.check_on_policy import (
    ONLINE_LAYOUTS,
    history,
    on_policy_config,
    online_config,
    run_online,
)
from tests.distributed.scripts.check_rollout import SAMPLING, rollout_config

pytestmark = pytest.mark.distributed
LAYOUTS = ["tp2", "dp2"]
MOE_LAYOUTS = ["moe_tp2_sp", "moe_tp2_sp_ep2", "moe_ep2"]


@pytest.fixture(scope="module")
def opd_setup(tmp_path_factory):
    """An SFT-distilled drafter (so that rounds accept some drafts and reject others) and its single-process HF
    rollout; a random Qwen3-MoE target (8 experts, top 2) with the pruned backbone adapted to it (not distilled)
    and its HF rollout."""
    setup = build_distill_setup(tmp_path_factory.mktemp("rollout_setup"))
    root = setup["root"]
    sft = tiny_distill_config(setup, checkpoint__save=str(root / "sft"), training__train_iters=20)
    with parallel_context(sft.parallel) as state:
        run_distill(sft, state)
    reference = run(rollout_config(str(setup["target"]), str(root / "sft"), str(setup["data"]), root / "hf"))
    moe = root / "moe"
    write_chat_target(moe, "qwen3_moe")
    adapt.run(
        AdaptConfig(
            backbone=str(root / "backbone"), target=str(moe), output=str(root / "moe_drafter"), aux_layer_ids=[1, 3, 4]
        )
    )
    run(rollout_config(str(moe), str(root / "moe_drafter"), str(setup["data"]), root / "moe_hf"))
    run(rollout_config(str(setup["target"]), str(root / "sft"), str(setup["data"]), root / "hf_sampled", **SAMPLING))
    return setup | {"sft": root / "sft", "hf_replays": sum(reference.replays)}


@pytest.fixture(scope="module")
def figures(opd_setup, tmp_path_factory):
    root = opd_setup["root"]
    extra = [str(opd_setup["target"]), str(root / "sft"), str(opd_setup["data"]), str(root / "hf")]
    extra += [str(root / "moe"), str(root / "moe_drafter"), str(root / "moe_hf"), str(root / "hf_sampled")]
    figures = run_torchrun("check_rollout.py", tmp_path_factory.mktemp("rollout"), timeout=400, extra=extra)
    return figures | {"hf_replays": opd_setup["hf_replays"]}


@pytest.fixture(scope="module")
def on_policy(opd_setup, tmp_path_factory):
    """On-policy distillation on the HF rollout store: one process, then TP=2, TP=2 + SP and DP=2 under torchrun."""
    root = opd_setup["root"]
    paths = [str(opd_setup["target"]), str(root / "sft"), str(opd_setup["data"]), str(root / "hf")]
    cfg = on_policy_config(*paths, root / "on_policy_1proc", ParallelConfig())
    with parallel_context(cfg.parallel) as state:
        reference = history(run_distill(cfg, state))
    online = history(run_online(online_config(*paths[:3], root / "online_1proc", ParallelConfig())))
    layouts = run_torchrun("check_on_policy.py", tmp_path_factory.mktemp("on_policy"), timeout=400, extra=paths)
    return {"1proc": reference, "online_1proc": online, **layouts}


def test_the_reference_rollout_has_rejections_and_replays(figures):
    assert figures["hf_samples"] == 6
    # rounds rejected after accepting some drafts, and the replays from their rejection positions
    assert figures["hf_rejected_after_accepting"] > 0 and figures["hf_replays"] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_megatron_rollout_records_the_hf_rollout(figures, layout):
    print(
        f"{layout}: {figures[f'{layout}_rounds']} rounds, max |p_megatron - p_hf| "
        f"{figures[f'{layout}_probs_max_abs']:.2e}, states {figures[f'{layout}_states_quanta']:.2f} bf16 quanta off"
    )
    assert figures[f"{layout}_samples"] == figures["hf_samples"]
    assert figures[f"{layout}_exact"] is True  # tokens, root rows, drafts, accepted counts, top-k ids
    assert figures[f"{layout}_rounds"] == figures["hf_rounds"]
    # Measured 6.7e-8 (float32 logits from TP-sharded matmuls against HF's, the same top-16 ids).
    assert figures[f"{layout}_probs_max_abs"] < 1e-6
    # Both stores round float32 states to bf16: values ~1e-7 apart round at most one quantum apart (at a tie).
    assert figures[f"{layout}_states_quanta"] <= 1.0


def test_one_writer_per_data_parallel_replica(figures):
    assert figures["tp2_writers"] == 1 and figures["dp2_writers"] == 2
    assert figures["tp2_rank0_prompts"] == figures["tp2_rank1_prompts"] == 6  # a TP group rolls out every prompt
    assert figures["dp2_rank0_prompts"] == figures["dp2_rank1_prompts"] == 3  # each replica its half


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_megatron_moe_rollout_records_the_hf_rollout(figures, layout):
    print(
        f"{layout}: {figures[f'{layout}_rounds']} rounds ({figures['moe_hf_accepted']} drafts accepted by HF), "
        f"max |p_megatron - p_hf| {figures[f'{layout}_probs_max_abs']:.2e}, "
        f"states {figures[f'{layout}_states_quanta']:.2f} bf16 quanta off"
    )
    assert figures[f"{layout}_samples"] == figures["hf_samples"]
    # drafts were accepted (37 of them, measured), and some prompts have odd lengths (padded under SP)
    assert figures["moe_hf_accepted"] > 0 and figures["moe_odd_prompts"] > 0
    assert figures[f"{layout}_exact"] is True
    assert figures[f"{layout}_rounds"] == figures["moe_hf_rounds"]
    assert figures[f"{layout}_probs_max_abs"] < 1e-6
    assert figures[f"{layout}_states_quanta"] <= 1.0
    # One replica in every layout: TP=2 links both ranks, and so does EP=2 across the two data-parallel ranks.
    assert figures[f"{layout}_writers"] == 1
    assert figures[f"{layout}_rank0_prompts"] == figures[f"{layout}_rank1_prompts"] == 6


@pytest.mark.parametrize("layout", list(ON_POLICY_LAYOUTS))
def test_on_policy_distillation_takes_the_same_updates_in_every_layout(on_policy, layout):
    want, got = on_policy["1proc"], on_policy[layout]
    loss = max(abs(a - b) for a, b in zip(want["loss/train"], got["loss/train"]))
    norm = max(abs(a - b) / a for a, b in zip(want["optim/grad_norm"], got["optim/grad_norm"]))
    print(f"on-policy {layout}: losses {got['loss/train']}, max |loss - 1 proc| {loss:.2e}, grad norm rel {norm:.2e}")
    assert len(got["loss/train"]) == len(want["loss/train"]) == 4
    # the loss moves (updates happen), and every layout follows the same trajectory
    assert want["loss/train"][-1] != want["loss/train"][0]
    assert loss < 1e-5 and norm < 1e-4
    assert got["acc/0"] == pytest.approx(want["acc/0"], abs=1e-6)


@pytest.mark.parametrize("layout", list(ONLINE_LAYOUTS))
def test_online_opd_takes_the_same_updates_in_every_layout(on_policy, layout):
    """Greedy rollouts are the target's own continuations, so each rank rolling out its half of a round gives the
    single process's round, and the updates follow the same trajectory."""
    want, got = on_policy["online_1proc"], on_policy[layout]
    loss = max(abs(a - b) for a, b in zip(want["loss/train"], got["loss/train"]))
    norm = max(abs(a - b) / a for a, b in zip(want["optim/grad_norm"], got["optim/grad_norm"]))
    print(f"online {layout}: losses {got['loss/train']}, max |loss - 1 proc| {loss:.2e}, grad norm rel {norm:.2e}")
    assert len(got["loss/train"]) == len(want["loss/train"]) == 2
    assert want["loss/train"][0] != want["loss/train"][1]  # two rounds, two different batches
    # Measured 0.0 for both (bit-exact: DP=2 all-reduces the same two halves the single process sums).
    assert loss < 1e-5 and norm < 1e-4


def test_a_sampled_rollout_does_not_depend_on_the_layout(figures):
    """Each prompt samples from its own seed: DP=2 (each replica half the prompts) draws the single-process
    rollout's tokens, and the rounds agree as in greedy decoding."""
    assert figures["sampled_differs_from_greedy"] is True
    assert figures["dp2_sampled_exact"] is True
    assert figures["dp2_sampled_rounds"] == figures["sampled_hf_rounds"]
    assert figures["dp2_sampled_probs_max_abs"] < 1e-6
    assert figures["dp2_sampled_writers"] == 2


def test_the_hf_target_under_torchrun_rolls_out_one_slice_per_rank(figures):
    """Each rank loads the HF target and rolls out half the prompts: the same store as one process, bit for bit."""
    assert figures["hf_dp2_exact"] is True and figures["hf_dp2_writers"] == 2
    assert figures["hf_dp2_probs_max_abs"] == 0.0 and figures["hf_dp2_states_quanta"] == 0.0
    assert figures["hf_dp2_rank0_prompts"] == figures["hf_dp2_rank1_prompts"] == 3
