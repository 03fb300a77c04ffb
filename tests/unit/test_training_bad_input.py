"""Stage 2 on bad input: out-of-vocabulary ids, non-finite losses, empty splits, a changed schedule on resume."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_osprey.parallel import parallel_context
from megatron_osprey.recipes import get_recipe, stage_resolver
from megatron_osprey.stages.pretrain import config_from_args as pretrain_config_and_invocation
from megatron_osprey.testing.tiny_models import VOCAB
from megatron_osprey.training.gpt_step import gpt_forward_step
from megatron_osprey.training.pretraining import run_pretrain
from tests.distributed.scripts.check_pretrain_fixtures import EOD, make_backbone, make_corpus


def config_from_args(argv):
    """The resolved PretrainConfig alone, with --recipe resolved by the registry."""
    return pretrain_config_and_invocation(argv, recipes=stage_resolver)[0]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    make_corpus(root / "data" / "corpus_text_document")
    make_backbone(root)
    return root


def write_docs(prefix: Path, docs: list[list[int]]) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    for doc in docs:
        builder.add_document(torch.tensor(doc, dtype=torch.int64), [len(doc)])
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def tiny(work, data=None, forward_step=gpt_forward_step, **changes):
    cfg = get_recipe("tiny_cpu_backbone_pretrain_2proc_fp32").pretrain
    cfg.model.backbone = str(work / "backbone")
    cfg.data.data_path = [data or str(work / "data" / "corpus_text_document")]
    cfg.training.train_iters = 6
    # The recipe's warmup is a fraction (0.1) of the run, resolved at run time: pin the 2 steps it gave the recipe's
    # 20, which the schedule checks below count on.
    cfg.optimizer.lr_warmup_iters = 2
    cfg.logging.progress_bar = False
    cfg.logging.eval_interval, cfg.logging.eval_iters = 6, 1
    for key, value in changes.items():
        section, field = key.split("__")
        setattr(getattr(cfg, section), field, value)
    with parallel_context(cfg.parallel) as state:
        return run_pretrain(cfg, state, forward_step)


def test_token_ids_beyond_the_vocabulary_are_refused_before_training_on_them(work, monkeypatch):
    from megatron_osprey.training import data

    # Token ids up to VOCAB + 40: as if tokenized with a bigger tokenizer than the model's.
    docs = [[(7 * i + j) % (VOCAB + 40) for j in range(80)] + [EOD] for i in range(60)]
    prefix = write_docs(work / "data" / "big_vocab_text_document", docs)
    assert data.max_token_id(prefix) == VOCAB + 39
    message = rf"--data-path .*big_vocab.*token id \d+ is outside the model's vocabulary of {VOCAB} ids"
    steps, real_collate = [], data.stack_samples

    def counting_collate(samples):
        steps.append(len(samples))
        return real_collate(samples)

    monkeypatch.setattr(data, "stack_samples", counting_collate)
    with pytest.raises(ValueError, match=message):
        tiny(work, prefix)
    assert not steps  # refused by the whole-file scan, before any batch was drawn
    # A corpus too big to scan is checked batch by batch: the first bad batch stops the run before it trains.
    monkeypatch.setattr(data, "FULL_SCAN_BYTES", 1)
    with pytest.raises(ValueError, match=message):
        tiny(work, prefix)
    assert steps


def nan_forward_step(data_iterator, model):
    output, loss_func = gpt_forward_step(data_iterator, model)
    return output * float("nan"), loss_func


def test_a_non_finite_loss_stops_the_run_instead_of_finishing_with_exit_0(work):
    with pytest.raises(FloatingPointError, match=r"loss was nan for 1 consecutive step\(s\) \(iteration 1\)"):
        tiny(work, forward_step=nan_forward_step)
    # Configurable: three consecutive non-finite steps are tolerated up to the third.
    with pytest.raises(FloatingPointError, match=r"for 3 consecutive step\(s\) \(iteration 3\)"):
        tiny(work, forward_step=nan_forward_step, training__max_nonfinite_loss_steps=3)
    cfg = config_from_args(["--max-nonfinite-loss-steps", "4"])
    assert cfg.training.max_nonfinite_loss_steps == 4


@pytest.mark.timeout(120)
def test_a_split_with_no_documents_is_refused_not_a_hang(work):
    # Two documents with the default 969,30,1 split: validation gets round(0.999*2) - round(0.969*2) = 0.
    prefix = write_docs(work / "data" / "two_docs_text_document", [list(range(1, 60)) + [EOD]] * 2)
    with pytest.raises(
        ValueError,
        match=r"--split 969,30,1: the validation split of .*two_docs_text_document "
        r"gets 0 of its 2 documents",
    ):
        tiny(work, prefix, data__split="969,30,1")


def test_an_empty_dataset_is_refused_naming_it(work):
    prefix = write_docs(work / "data" / "empty_text_document", [])
    with pytest.raises(ValueError, match=r"--data-path .*empty_text_document: the dataset holds 0 documents"):
        tiny(work, prefix)


def lr_history(result):
    return [h["optim/lr"] for h in result.history if "optim/lr" in h]


def test_resume_refuses_a_changed_schedule_or_honours_it_when_asked(work):
    save = str(work / "ck_schedule")
    tiny(work, checkpoint__save=save, checkpoint__save_interval=3, training__exit_interval=3)
    with pytest.raises(ValueError, match=r"--lr gives max_lr = 0.002 but the checkpoint's schedule has 0.001"):
        tiny(work, checkpoint__load=save, optimizer__lr=2e-3)
    with pytest.raises(ValueError, match=r"--min-lr gives min_lr = 0.0002 but the checkpoint's schedule has 0.0001"):
        tiny(work, checkpoint__load=save, optimizer__min_lr=2e-4)
    with pytest.raises(
        ValueError,
        match=r"--train-iters \(the decay length\) gives lr_decay_steps = 12 but "
        r"the checkpoint's schedule has 6",
    ):
        tiny(work, checkpoint__load=save, training__train_iters=12)
    # Asked for, the new values are what the run uses: cosine from 2e-3 to 2e-4 over 6 steps, 2 of warmup.
    resumed = tiny(
        work,
        checkpoint__load=save,
        optimizer__lr=2e-3,
        optimizer__min_lr=2e-4,
        optimizer__override_opt_param_scheduler=True,
    )
    expected = [2e-4 + 0.5 * (2e-3 - 2e-4) * (1 + math.cos(math.pi * (step - 2) / 4)) for step in (3, 4, 5)]
    assert lr_history(resumed) == pytest.approx(expected, rel=1e-6)
    assert resumed.state.iteration == 6


def test_an_unwritable_save_is_refused_before_training(work, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match=r"--save .*a_file/ckpt cannot be written"):
        tiny(work, checkpoint__save=str(blocker / "ckpt"))


def test_the_entry_point_prints_one_line_for_bad_input(work, capsys):
    from megatron_osprey.recipes import run_stage

    prefix = write_docs(work / "data" / "empty2_text_document", [])
    # The recipe's own save and TensorBoard paths are under the working directory: point them here.
    out = str(work / "bad_input_run")
    code = run_stage(
        "pretrain",
        [
            "--recipe",
            "tiny_cpu_backbone_pretrain_2proc_fp32",
            "--backbone",
            str(work / "backbone"),
            "--data-path",
            prefix,
            "--train-iters",
            "4",
            "--no-progress-bar",
            "--save",
            out,
            "--load",
            out,
            "--tensorboard-dir",
            out,
        ],
    )
    err = capsys.readouterr().err
    assert code == 2 and "error: --data-path" in err and "holds 0 documents" in err and "Traceback" not in err


def test_a_warmup_as_long_as_the_run_is_refused_naming_the_flag():
    # Megatron's scheduler would stop on a bare `assert lr_warmup_steps < lr_decay_steps`.
    cfg = config_from_args(
        [
            "--recipe",
            "tiny_cpu_backbone_pretrain_2proc_fp32",
            "--train-iters",
            "2",
            "--lr-warmup-iters",  # the recipe's warmup is now a fraction of the run: name the 2 steps it gave
            "2",
            "--hf-model",
            "x",
            "--data-path",
            "p",
        ]
    )
    from megatron_osprey.training.config import validate_optimizer

    with pytest.raises(ValueError, match=r"--lr-warmup-iters 2 must be below the decay length 2"):
        validate_optimizer(cfg.optimizer, cfg.training)
