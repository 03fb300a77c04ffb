"""GLM-4.5 and gpt-oss (MXFP4 experts) targets at TP=2+SP and EP=2 against HF's own forward, and a tiny drafter
distilled online on GLM-4.5 at EP=2 (one torchrun + gloo launch)."""

import pytest

from tests.distributed.launch import run_torchrun

pytestmark = pytest.mark.distributed

FAMILIES = ["glm4_moe", "gpt_oss"]


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    """A 2-layer backbone pruned from a tiny LM with another tokenizer, adapted to a random GLM-4.5 target."""
    from megatron_osprey.stages import adapt, prune
    from megatron_osprey.stages.adapt import AdaptConfig
    from megatron_osprey.stages.prune import PruneConfig
    from megatron_osprey.testing.distill_setup import write_chat_model, write_topic_conversations
    from megatron_osprey.testing.tiny_models import write_chat_target

    root = tmp_path_factory.mktemp("glm_setup")
    small_lm = write_chat_model(root / "small_lm", "llama3", layers=2, hidden=64, seed=2, qwen3=True)
    prune.run(PruneConfig(source=str(small_lm), output=str(root / "backbone"), num_layers=2, transformer_impl="local"))
    write_chat_target(root / "glm", "glm4_moe")
    adapt.run(
        AdaptConfig(
            backbone=str(root / "backbone"),
            target=str(root / "glm"),
            output=str(root / "drafter"),
            aux_layer_ids=[1, 3, 4],
        )
    )
    data = write_topic_conversations(root / "train.jsonl", 16)
    extra = [str(root / "glm"), str(root / "drafter"), str(data)]
    return run_torchrun("check_targets_glm_gptoss.py", tmp_path_factory.mktemp("glm_gptoss"), timeout=300, extra=extra)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["tp2_sp", "ep2"])
def test_every_layer_and_the_logits_equal_hf(figures, family, layout):
    states = figures[f"{family}_{layout}_states_max_abs"] / figures[f"{family}_hf_states_max"]
    logits = figures[f"{family}_{layout}_logits_max_abs"]
    print(f"{family} {layout}: states max rel {states:.2e}, logits max abs {logits:.2e}")
    # Measured: states 7.6e-7 / 6.2e-7 (GLM) and 4.7e-6 / 4.5e-6 (gpt-oss) of their max, logits 4.8e-7 / 4.6e-7 and
    # 3.6e-6 / 4.1e-6 (of max 0.65): float32 summation order. A missing term moves them far: gpt-oss without its
    # sinks measured logits off by 0.61 (states 0.75 of max), without the SwiGLU clamp by 0.78 (states 1.9).
    assert states < 2e-5
    assert logits < 2e-5
    assert figures[f"{family}_{layout}_local_experts"] == (4 if layout == "ep2" else 8)


def test_a_drafter_distills_online_on_the_glm_target_at_ep2(figures):
    losses, accuracy = figures["distill_loss/train"], figures["distill_acc/0"]
    print(f"distill on glm4_moe at EP 2: losses {losses}, acc/0 {accuracy}")
    assert len(losses) == 4 and all(0 < loss < 100 for loss in losses)
    # Measured 24.6, 20.8, 17.0, 16.5: the drafter learns from the MoE target's distribution in 4 updates.
    assert losses[-1] < 0.85 * losses[0]
    assert all(0 < norm < 1e3 for norm in figures["distill_optim/grad_norm"])
