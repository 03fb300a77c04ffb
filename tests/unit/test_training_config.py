"""Stage 2 flags, recipes, --set overrides and the one-sentence input errors."""

import pytest

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.models.backbone.config import validate_numerics
from megatron_osprey.parallel.config import ParallelConfig
from megatron_osprey.recipes.registry import stage_resolver
from megatron_osprey.stages.pretrain import PretrainConfig
from megatron_osprey.stages.pretrain import config_from_args as _config_and_invocation
from megatron_osprey.testing.tiny_models import qwen3_config
from megatron_osprey.training.config import validate_training
from megatron_osprey.training.data import check_prefixes, parse_blend
from megatron_osprey.training.pretraining import validate_against_model


def config_from_args(argv):
    """The resolved PretrainConfig alone, with --recipe resolved by the registry."""
    return _config_and_invocation(argv, recipes=stage_resolver)[0]


def test_megatron_flags_land_in_their_sections():
    cfg = config_from_args(
        [
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "4",
            "--sequence-parallel",
            "--use-distributed-optimizer",
            "--micro-batch-size",
            "3",
            "--global-batch-size",
            "96",
            "--seq-length",
            "2048",
            "--train-samples",
            "1000",
            "--lr",
            "2e-4",
            "--min-lr",
            "2e-5",
            "--lr-decay-style",
            "WSD",
            "--lr-wsd-decay-iters",
            "50",
            "--clip-grad",
            "0.5",
            "--bf16",
            "--data-path",
            "0.7",
            "A",
            "0.3",
            "B",
            "--split",
            "98,2,0",
            "--save",
            "S",
            "--exit-signal-handler",
        ]
    )
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.parallel.pipeline_model_parallel_size == 4
    assert cfg.parallel.sequence_parallel and cfg.optimizer.use_distributed_optimizer and cfg.model.bf16
    assert (cfg.training.micro_batch_size, cfg.training.global_batch_size, cfg.training.seq_length) == (3, 96, 2048)
    assert cfg.training.num_train_iters() == 11  # ceil(1000 / 96)
    assert cfg.optimizer.lr == 2e-4 and cfg.optimizer.lr_decay_style == "WSD" and cfg.optimizer.clip_grad == 0.5
    assert parse_blend(cfg.data.data_path) == (["A", "B"], [0.7, 0.3])
    assert cfg.checkpoint.save == "S" and cfg.training.exit_signal_handler


def test_recipe_then_flags_then_set():
    cfg, invocation = _config_and_invocation(
        [
            "--recipe",
            "qwen3_4b_backbone_pretrain_10k_64gpu_h100_bf16",
            "--lr",
            "1e-4",
            "--set",
            "optimizer.lr=5e-5",
            "--set",
            "training.seq_length=1024",
        ],
        recipes=stage_resolver,
    )
    assert invocation.recipe == "qwen3_4b_backbone_pretrain_10k_64gpu_h100_bf16"
    assert cfg.model.bf16 and cfg.optimizer.use_distributed_optimizer  # from the recipe, untouched
    # The recipe's batch (recipes/backbone.py GLOBAL_BATCH: 462B tokens / 55k steps / 4,096); was 256 before the
    # restructuring.
    assert cfg.training.global_batch_size == 2048
    assert cfg.optimizer.lr == 5e-5 and isinstance(cfg.optimizer.lr, float)  # --set wins over the flag
    assert cfg.training.seq_length == 1024


def test_unknown_set_key_names_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:  # bad input: argparse's one line, exit 2
        config_from_args(["--set", "optimizer.lrr=1"])
    assert exit_info.value.code == 2
    assert "no key 'lrr' in optimizer; valid keys: lr, min_lr" in capsys.readouterr().err


def test_unknown_recipe_is_refused():
    with pytest.raises(SystemExit):
        config_from_args(["--recipe", "nope"])


def test_global_batch_not_divisible_by_micro_batch_times_dp():
    cfg = PretrainConfig()
    cfg.training.train_iters, cfg.training.micro_batch_size, cfg.training.global_batch_size = 10, 4, 20
    with pytest.raises(
        ValueError,
        match=r"--global-batch-size 20 is not divisible by --micro-batch-size 4 "
        r"x data-parallel size 2 = 8\.",
    ):
        validate_training(cfg.training, ParallelConfig(), world_size=2)


def test_missing_data_prefix_names_both_files(tmp_path):
    prefix = str(tmp_path / "web_text_document")
    (tmp_path / "web_text_document.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=rf"--data-path {prefix}: {prefix}.idx not found"):
        check_prefixes([prefix])


def test_odd_blend_is_refused():
    with pytest.raises(ValueError, match="WEIGHT PREFIX pairs"):
        parse_blend(["0.5", "A", "B"])


def _arch():
    return ModelArch.from_hf_config(qwen3_config(layers=2))  # max_position_embeddings 256


def test_seq_length_above_max_positions():
    cfg = PretrainConfig()
    cfg.training.seq_length = 512
    with pytest.raises(ValueError, match=r"--seq-length 512 exceeds the model's max_position_embeddings \(256\)"):
        validate_against_model(cfg, _arch())


def test_tensor_parallel_must_divide_heads_and_pipeline_the_layers():
    cfg = PretrainConfig()
    cfg.training.seq_length = 64
    cfg.parallel = ParallelConfig(tensor_model_parallel_size=8)
    with pytest.raises(
        ValueError, match="--tensor-model-parallel-size 8 does not divide the model's num_attention_heads"
    ):
        validate_against_model(cfg, _arch())
    cfg.parallel = ParallelConfig(pipeline_model_parallel_size=4)
    with pytest.raises(
        ValueError, match="--pipeline-model-parallel-size 4 does not divide the model's num_hidden_layers"
    ):
        validate_against_model(cfg, _arch())


def test_fp8_on_cpu_says_transformer_engine_and_cuda():
    cfg = PretrainConfig()
    cfg.model.fp8_format = "hybrid"
    with pytest.raises(RuntimeError, match="--fp8-format needs CUDA and Transformer Engine"):
        validate_numerics(cfg.model)


def test_backbone_and_hf_model_are_exclusive(tmp_path):
    cfg = PretrainConfig()
    cfg.training.train_iters = 1
    cfg.data.data_path = ["x"]
    with pytest.raises(ValueError, match="exactly one of --backbone"):
        cfg.validate(1)
    cfg.model.backbone = str(tmp_path)
    with pytest.raises(FileNotFoundError, match="no run_config.yaml there"):
        cfg.validate(1)
