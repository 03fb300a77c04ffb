"""Golden losses of a tiny fixed Stage 2 run, single process; plus exact resume with the plain optimizer."""

import json
import os
from pathlib import Path

import pytest

from megatron_osprey.base.run_config import load_run_config
from megatron_osprey.parallel import parallel_context
from megatron_osprey.recipes import get_recipe
from megatron_osprey.training.pretraining import run_pretrain
from tests.distributed.scripts.check_pretrain_fixtures import make_backbone, make_corpus, plain_pytorch_run

GOLDEN = Path(__file__).with_name("test_training_golden_losses.json")
REFERENCE_STEPS = 10
REFERENCE_BOUND = 1e-5  # measured 9.5e-7 over the first 10 steps (losses ~5.7)
WEIGHT_BOUND = 6e-6  # measured 6.0e-7


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("golden")
    make_corpus(root / "data" / "corpus_text_document")
    make_backbone(root)
    return root


def tiny_config(work):
    cfg = get_recipe("tiny_cpu_backbone_pretrain_2proc_fp32").pretrain
    cfg.model.backbone = str(work / "backbone")
    cfg.data.data_path = [str(work / "data" / "corpus_text_document")]
    cfg.training.train_iters = 10
    # The golden run's fixed warmup (the recipe's warmup is 10% of the run, 1 step of these 10).
    cfg.optimizer.lr_warmup_iters = 2
    cfg.logging.progress_bar = False
    cfg.logging.eval_interval, cfg.logging.eval_iters = 10, 1
    return cfg


def tiny(work, **checkpoint):
    cfg = tiny_config(work)
    for key, value in checkpoint.items():
        section = cfg.training if key == "exit_interval" else cfg.checkpoint
        setattr(section, key, value)
    with parallel_context(cfg.parallel) as state:
        result = run_pretrain(cfg, state)
    return result


def losses(result, key="loss/train"):
    return [h[key] for h in result.history if key in h]


@pytest.fixture(scope="module")
def straight(work):
    # Saves at 5 (the resume test loads it) and at 10, where the finished run also writes hf/.
    return tiny(work, save=str(work / "ck_plain"), save_interval=5)


def test_first_ten_losses_match_the_golden_file(straight):
    result = straight
    got = losses(result)
    if os.environ.get("OSPREY_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps({"config": "tiny_pretrain_cpu_fp32, 10 iterations", "losses": got}, indent=1))
    golden = json.loads(GOLDEN.read_text())["losses"]
    assert got == pytest.approx(golden, abs=1e-4)
    assert len(losses(result, "loss/valid")) == 1


def test_losses_and_weights_match_a_plain_pytorch_run(work, straight):
    # Independent of the golden file (which this code wrote): the HF model, torch.optim.AdamW,
    # torch's clipping and the schedule written out, on the same global batches.
    from safetensors.torch import load_file

    reference, model = plain_pytorch_run(work, tiny_config(work), REFERENCE_STEPS)
    ours = losses(straight)[:REFERENCE_STEPS]
    assert losses(straight, "optim/lr")[:REFERENCE_STEPS] == pytest.approx(reference["lr"], rel=1e-6, abs=0)
    error = max(abs(a - b) for a, b in zip(ours, reference["loss"]))
    # The weights after 10 updates are far more sensitive than the losses: largest |difference|
    # relative to the largest |value| of each tensor, over every tensor of the exported HF model.
    exported = load_file(work / "ck_plain" / "hf" / "model.safetensors")
    expected = model.state_dict()
    weight_error = max(((exported[k] - expected[k]).abs().max() / expected[k].abs().max()).item() for k in exported)
    print(f"first {REFERENCE_STEPS} steps vs plain pytorch: losses {error:.2e}, weights (relative) {weight_error:.2e}")
    assert error < REFERENCE_BOUND
    assert weight_error < WEIGHT_BOUND


def test_resume_is_exact_with_the_plain_optimizer(work, straight):
    resumed = tiny(work, load=str(work / "ck_plain"), ckpt_step=5)
    assert losses(resumed) == losses(straight)[5:]
    assert losses(resumed, "optim/lr") == losses(straight, "optim/lr")[5:]
    saved = load_run_config(work / "ck_plain" / "iter_0000005")
    assert saved["stage"] == "pretrain" and saved["hf_config"]["num_hidden_layers"] == 2
    assert saved["config"]["training"]["train_iters"] == 10
