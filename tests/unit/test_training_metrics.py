"""FLOPs formula (LM head included), MFU, wandb run ids, the scheduler's WSD shape, signal agreement."""

import signal

import pytest

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.training.flops import forward_flops_per_sequence, mfu, training_flops_per_sequence
from megatron_osprey.training.metrics import WANDB_ID_FILE, format_line, wandb_run_id
from megatron_osprey.training.signals import SignalFlag


def _arch(layers, hidden, ffn, heads, kv_heads, head_dim, vocab):
    return ModelArch.from_hf_config(
        {
            "model_type": "qwen3",
            "num_hidden_layers": layers,
            "hidden_size": hidden,
            "intermediate_size": ffn,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "vocab_size": vocab,
        }
    )


QWEN3_4B_2L = _arch(2, 2560, 9728, 32, 8, 128, 151936)


def test_forward_flops_by_hand():
    shape = _arch(1, 4, 8, 2, 1, 2, 10)
    s = 3
    qkv = 2 * s * 4 * (4 + 2 * 2)  # 192
    proj = 2 * s * 4 * 4  # 96
    attn = 2 * 2 * s * 4 * (s + 1) / 2  # 96: causal half
    mlp = 2 * s * 4 * 8 * 3  # 576: gate, up, down
    head = 2 * s * 4 * 10  # 240
    assert forward_flops_per_sequence(shape, s, 10) == qkv + proj + attn + mlp + head
    assert training_flops_per_sequence(shape, s, 10) == 3 * (qkv + proj + attn + mlp + head)


def test_lm_head_dominates_the_two_layer_backbone():
    s = 4096
    total = forward_flops_per_sequence(QWEN3_4B_2L, s, 151936)
    head = 2 * s * 2560 * 151936
    assert head / total > 0.5
    # 6 x (GEMM parameters, head included: ~591M) x tokens, plus causal attention: ~15.3 TFLOP.
    gemm_params = 2 * (2560 * (4096 + 2 * 1024) + 4096 * 2560 + 3 * 2560 * 9728) + 2560 * 151936
    attention = 3 * 2 * (2 * 2 * s * 4096 * (s + 1) / 2)
    assert training_flops_per_sequence(QWEN3_4B_2L, s, 151936) == pytest.approx(
        6 * gemm_params * s + attention, rel=1e-12
    )
    assert training_flops_per_sequence(QWEN3_4B_2L, s, 151936) == pytest.approx(15.34e12, rel=0.01)


def test_mfu_is_na_without_a_peak():
    assert mfu(100.0, None) is None
    assert mfu(247.25, 989.0) == pytest.approx(0.25)
    assert "n/a" in format_line(1, 10, {"loss/train": 1.0})


def test_wandb_run_id_is_stable_and_stored_id_wins(tmp_path):
    first = wandb_run_id(str(tmp_path), "exp", "proj")
    assert first == wandb_run_id(str(tmp_path), "exp", "proj")
    assert first != wandb_run_id(str(tmp_path), "other", "proj")
    (tmp_path / WANDB_ID_FILE).write_text("abc123\n")
    assert wandb_run_id(str(tmp_path), "exp", "proj") == "abc123"


def test_signal_flag_catches_sigterm_and_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    with SignalFlag() as flag:
        signal.raise_signal(signal.SIGTERM)
        assert flag.received
    assert signal.getsignal(signal.SIGTERM) == before


def test_wsd_schedule_holds_then_decays():
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_osprey.training.config import OptimizerConfig
    from megatron_osprey.training.scheduler import build_scheduler

    class Opt:
        param_groups = [{"params": [torch.nn.Parameter(torch.zeros(1))]}]

    section = OptimizerConfig(
        lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_style="WSD", lr_wsd_decay_iters=4, lr_wsd_decay_style="linear"
    )
    sched = build_scheduler(Opt(), section, train_iters=10)
    assert isinstance(sched, OptimizerParamScheduler)
    lrs = []
    for _ in range(11):
        lrs.append(Opt.param_groups[0]["lr"])
        sched.step(1)
    assert lrs[:3] == [0.0, 0.5, 1.0]
    assert lrs[3:7] == [1.0] * 4  # stable until the last 4 iterations
    assert lrs[7:] == pytest.approx([0.775, 0.55, 0.325, 0.1])


def test_tensorboard_and_offline_wandb_get_the_metrics_and_no_secret(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_osprey.training.config import LoggingConfig
    from megatron_osprey.training.metrics import MetricsLogger, ThroughputModel

    cfg = LoggingConfig(
        log_interval=1,
        wandb_project="p",
        wandb_exp_name="e",
        progress_bar=False,
        tensorboard_dir=str(tmp_path / "tb"),
        peak_tflops=1.0,
    )
    save = tmp_path / "save"
    logger = MetricsLogger(
        cfg,
        ThroughputModel(1000, 1e12, 2, cfg.peak_tflops),
        is_writer=True,
        total_iters=2,
        start_iter=0,
        save_dir=str(save),
        run_config={"wandb_api_key": "SECRET-123"},
    )
    logger.step(1, 2.0, 1e-3, 0.5)
    written = logger.step(2, 1.0, 5e-4, 0.25)
    logger.validation(2, 1.5)
    logger.close()
    assert written["loss/train"] == 1.0 and written["optim/lr"] == 5e-4 and written["optim/grad_norm"] == 0.25
    assert written["throughput/mfu"] == pytest.approx(written["throughput/tflops_per_gpu"])
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "loss/train",
        "loss/valid",
        "optim/lr",
        "optim/grad_norm",
        "throughput/tokens_per_sec_per_gpu",
        "throughput/tflops_per_gpu",
        "throughput/mfu",
        "memory/max_allocated_gib",
    } <= tags
    assert [e.value for e in events.Scalars("loss/train")] == [2.0, 1.0]
    run_id = (save / "wandb_run_id.txt").read_text().strip()
    assert run_id == wandb_run_id(str(save), "e", "p")
    assert list((save / "wandb").rglob(f"offline-run-*-{run_id}"))
    for path in save.rglob("*"):
        if path.is_file():
            assert b"SECRET-123" not in path.read_bytes()


def test_run_config_redacts_keys_but_keeps_token_ids():
    from megatron_osprey.base.run_config import to_plain

    plain = to_plain(
        {"wandb_api_key": "k", "hf_token": "t", "eos_token_id": 7, "eod_token_id": 3, "bad_words_token_ids": [1]}
    )
    assert plain == {
        "wandb_api_key": "<redacted>",
        "hf_token": "<redacted>",
        "eos_token_id": 7,
        "eod_token_id": 3,
        "bad_words_token_ids": [1],
    }
