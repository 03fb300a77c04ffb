"""A resume continues the same run (other data, batch or length is refused naming the setting and both values);
a diverged run never saves non-finite weights."""

import pytest

from megatron_osprey.data.config import IndexedDataConfig
from megatron_osprey.models.backbone.config import BackboneConfig
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.stages.pretrain import PretrainConfig
from megatron_osprey.testing.tiny_models import make_hf_model, qwen3_config
from megatron_osprey.training.config import CheckpointConfig, LoggingConfig, OptimizerConfig, TrainingConfig
from megatron_osprey.training.gpt_step import gpt_forward_step
from megatron_osprey.training.pretraining import run_pretrain
from megatron_osprey.training.resume_check import compare_run_identity, setting
from tests.distributed.scripts.check_pretrain_fixtures import EOD, make_corpus


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_checks")
    config = qwen3_config(layers=2)
    config.eos_token_id = EOD
    make_hf_model(config, root / "hf")
    make_corpus(str(root / "a" / "corpus_text_document"))
    make_corpus(str(root / "b" / "corpus_text_document"), seed=1)
    return root


def pretrain(work, save, data="a", iters=2, forward_step=gpt_forward_step, **training):
    training["train_iters"] = iters
    cfg = PretrainConfig(
        model=BackboneConfig(hf_model=str(work / "hf"), transformer_impl="local"),
        parallel=ParallelConfig(),
        training=TrainingConfig(**{"micro_batch_size": 2, "global_batch_size": 2, "seq_length": 32} | training),
        optimizer=OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_decay_iters=10),  # a run may extend
        data=IndexedDataConfig(data_path=[str(work / data / "corpus_text_document")], split="90,10,0"),
        checkpoint=CheckpointConfig(save=str(save), load=str(save)),
        logging=LoggingConfig(progress_bar=False, eval_iters=0, log_interval=100),
    )
    with parallel_context(cfg.parallel) as state:
        return run_pretrain(cfg, state, forward_step)


def test_a_resume_with_another_data_path_is_refused_naming_both(work, tmp_path):
    save = tmp_path / "save"
    pretrain(work, save, iters=2)
    with pytest.raises(
        ValueError,
        match=rf"--load {save}: --data-path: the checkpoint has .*/a/corpus_text_document \(content \w+\), this run "
        rf".*/b/corpus_text_document \(content \w+\); a resume must continue the same run",
    ):
        pretrain(work, save, data="b", iters=4)
    with pytest.raises(ValueError, match=r"--seq-length: the checkpoint has 32, this run 64"):
        pretrain(work, save, iters=4, seq_length=64)
    result = pretrain(work, save, iters=4)  # the same run extends
    assert result.state.iteration == 4


def test_layout_changes_are_noted_optimizer_changes_need_the_override():
    saved = {"--micro-batch-size": setting(1), "--clip-grad": setting(1.0), "--split": setting("969,30,1")}
    assert compare_run_identity("R", saved, saved, False) == []
    notes = compare_run_identity("R", saved, saved | {"--micro-batch-size": setting(2)}, False)
    assert notes == ["resuming with another layout (--micro-batch-size: the checkpoint has 1, this run 2)"]
    clip = saved | {"--clip-grad": setting(0.5)}
    with pytest.raises(ValueError, match=r"--clip-grad: the checkpoint has 1.0, this run 0.5.*--override-opt-param"):
        compare_run_identity("R", saved, clip, False)
    assert compare_run_identity("R", saved, clip, True) == [
        "--override-opt-param-scheduler: --clip-grad: the checkpoint has 1.0, this run 0.5"
    ]
    with pytest.raises(ValueError, match=r"--split: the checkpoint has \"969,30,1\", this run \(not set\)"):
        compare_run_identity("R", saved, {k: v for k, v in saved.items() if k != "--split"}, True)


def test_nan_weights_are_never_saved_as_the_result_even_when_nan_losses_are_allowed(work, tmp_path):
    from megatron_osprey.training.checkpointing import LATEST_FILE

    def nan_forward_step(data_iterator, model):
        output, loss_func = gpt_forward_step(data_iterator, model)
        return output * float("nan"), loss_func

    save = tmp_path / "save"
    with pytest.raises(FloatingPointError, match=r"the weights hold NaN or inf at iteration 2 \(.*\); not saving them"):
        pretrain(work, save, iters=2, forward_step=nan_forward_step, max_nonfinite_loss_steps=0)
    assert not (save / LATEST_FILE).exists() and not (save / "hf").exists()
