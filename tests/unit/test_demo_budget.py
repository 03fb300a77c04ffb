"""make demo's time budget: a few-second GEMM probe, the prediction of each trained step from its FLOPs per
iteration, and the resize, a pure function of (rate, budget), that makes the prediction fit."""

import dataclasses
import json
import time

import pytest

from megatron_osprey.demo import budget
from megatron_osprey.demo.budget import BUDGET_SECONDS, DISTILL_FLOOR, STAGE2_FLOOR, TrainedStep, resize, scaled
from megatron_osprey.demo.sizes import DemoConfig

# The quick demo's trained steps as demo_trained_steps counts them on SmolLM2-135M (FLOPs per iteration, the
# figures the stages themselves log: 438.5 / 1096.3 / 330.7 GFLOP).
QUICK = [
    TrainedStep("pretrain", 120, 438.5e9),
    TrainedStep("distill_osprey", 48, 1096.3e9),
    TrainedStep("distill_eagle3", 48, 330.7e9),
]
OTHER = budget.other_reference_seconds(96, vllm=False)


def _total(rate, s2, d):
    steps = [dataclasses.replace(s, iterations=scaled(s.iterations, s2 if s.name == "pretrain" else d)) for s in QUICK]
    return resize(rate, float("inf"), steps, OTHER).predicted


def _rate_for(s2, d):
    """The GEMM rate at which the quick demo at these scales takes exactly the budget (the model is decreasing)."""
    low, high = 1e-3, 1e6
    for _ in range(100):
        middle = (low * high) ** 0.5
        low, high = (middle, high) if _total(middle, s2, d) > BUDGET_SECONDS else (low, middle)
    return high


def test_a_fast_machine_keeps_the_sizes():
    decision = resize(1.01 * _rate_for(1.0, 1.0), BUDGET_SECONDS, QUICK, OTHER)
    assert not decision.resized and decision.predicted == decision.predicted_after <= BUDGET_SECONDS


def test_a_slower_machine_shortens_stage2_first_to_the_largest_size_that_fits():
    rate = (_rate_for(1.0, 1.0) * _rate_for(STAGE2_FLOOR, 1.0)) ** 0.5  # over budget, but Stage 2 can absorb it
    decision = resize(rate, BUDGET_SECONDS, QUICK, OTHER)
    assert decision.predicted > BUDGET_SECONDS and decision.resized
    assert STAGE2_FLOOR < decision.stage2_scale < 1.0 and decision.distill_scale == 1.0
    assert decision.predicted_after <= BUDGET_SECONDS
    assert _total(rate, decision.stage2_scale, 1.0) == pytest.approx(decision.predicted_after)
    assert _total(rate, decision.stage2_scale + 0.01, 1.0) > BUDGET_SECONDS  # the largest that fits, to 1%


def test_a_much_slower_machine_also_shortens_distillation():
    rate = (_rate_for(STAGE2_FLOOR, 1.0) * _rate_for(STAGE2_FLOOR, 0.4)) ** 0.5
    decision = resize(rate, BUDGET_SECONDS, QUICK, OTHER)
    assert decision.stage2_scale == STAGE2_FLOOR and DISTILL_FLOOR < decision.distill_scale < 1.0
    assert decision.predicted_after <= BUDGET_SECONDS < _total(rate, STAGE2_FLOOR, decision.distill_scale + 0.01)


def test_the_resize_is_a_pure_monotone_function_of_rate_and_budget():
    rates = [_rate_for(1.0, 1.0) * f for f in (0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0)]
    decisions = [resize(r, BUDGET_SECONDS, QUICK, OTHER) for r in rates]
    assert decisions == [resize(r, BUDGET_SECONDS, QUICK, OTHER) for r in rates]  # no clock, no state
    scales = [(d.stage2_scale, d.distill_scale) for d in decisions]
    assert scales == sorted(scales) and scales[-1] == (1.0, 1.0)
    assert resize(rates[4], 2 * BUDGET_SECONDS, QUICK, OTHER).stage2_scale > decisions[4].stage2_scale
    with pytest.raises(ValueError, match="GEMM rate must be positive"):
        resize(0.0, BUDGET_SECONDS, QUICK, OTHER)


def test_the_probe_takes_a_few_seconds_and_measures_a_rate():
    began = time.perf_counter()
    rate = budget.gemm_rate(threads=1, seconds=0.5)
    assert time.perf_counter() - began < 3.0
    assert rate > 0.5  # GFLOP/s: even an emulated path is above this; a broken count would be 0 or inf
    assert rate < 1e4


@pytest.fixture
def smollm2_like(tmp_path):
    """SmolLM2-135M's config.json (the demo's target): what demo_trained_steps reads."""
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
    }
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(config))
    return tmp_path / "target"


def test_the_demo_counts_its_steps_flops_as_the_stages_log_them(smollm2_like):
    steps = budget.demo_trained_steps(DemoConfig.quick(), smollm2_like, samples=96)
    # The FLOPs per iteration the stages logged in the calibration runs (tflops x iteration time), to 0.01 GFLOP:
    # the count here agrees to 1.1e-5 after that rounding (2.5e-6 before it).
    logged = {"pretrain": 438.50e9, "distill_osprey": 1096.27e9, "distill_eagle3": 330.70e9}
    for step in steps:
        assert step.flops_per_iteration == pytest.approx(logged[step.name], rel=2e-5)
    assert [(s.name, s.iterations) for s in steps] == [
        ("pretrain", 120),
        ("distill_osprey", 48),
        ("distill_eagle3", 48),
    ]


def test_fit_to_budget_says_what_it_changed_and_a_resumed_run_keeps_it(smollm2_like, tmp_path, monkeypatch):
    from megatron_osprey.demo.report import _resized_lines

    slow = 0.7 * _rate_for(1.0, 1.0)
    monkeypatch.setattr(budget, "gemm_rate", lambda threads, seconds=2.0: slow)
    lines = []
    cfg = budget.fit_to_budget(DemoConfig.quick(), smollm2_like, tmp_path, BUDGET_SECONDS, 2, False, lines.append)
    (line,) = lines
    assert (
        line.startswith(f"budget: float32 GEMM {slow:.1f} GFLOP/s on 2 thread(s)") and "RESIZED Stage 2 120 -> " in line
    )
    assert cfg.backbone_iters < 120 and cfg.resized == line
    assert _resized_lines(cfg)[0].startswith(f"**Resized to fit the time budget**: Stage 2 ran {cfg.backbone_iters}")

    def no_probe(*args, **kwargs):
        raise AssertionError("a resumed run must not measure again")

    monkeypatch.setattr(budget, "gemm_rate", no_probe)
    again = budget.fit_to_budget(DemoConfig.quick(), smollm2_like, tmp_path, BUDGET_SECONDS, 2, False, lines.append)
    assert again == cfg and lines[-1] == f"budget: resuming with the sizes the first run chose: {line}"

    monkeypatch.setattr(budget, "gemm_rate", lambda threads, seconds=2.0: 2 * _rate_for(1.0, 1.0))
    fast = budget.fit_to_budget(DemoConfig.quick(), smollm2_like, tmp_path / "fast", BUDGET_SECONDS, 2, False, print)
    assert fast == DemoConfig.quick() and _resized_lines(fast) == []


@pytest.mark.parametrize(
    "argv, cpu, minutes",
    [
        ([], "avx2", 30.0),
        (["--no-resize"], "avx2", None),
        (["--time-budget", "45"], "avx2", 45.0),
        (["--smoke"], "avx2", None),
        ([], "avx512_bf16", None),  # the model is calibrated on the float32 path: a bf16 CPU runs as configured
        (["--time-budget", "30"], "avx512_bf16", 30.0),
    ],
)
def test_make_demo_is_fitted_to_30_minutes_unless_told_otherwise(monkeypatch, tmp_path, argv, cpu, minutes):
    import megatron_osprey.demo.__main__ as demo
    import megatron_osprey.demo.pipeline as pipeline

    seen = {}

    def record(cfg, output, fresh=False, budget=None, **engine):
        seen["budget"] = budget
        raise RuntimeError("stopped after the config")

    monkeypatch.setattr(pipeline, "run_demo", record)
    monkeypatch.setenv("OSPREY_CPU_CAPABILITY", cpu)
    assert demo.main([*argv, "--output", str(tmp_path)]) == 1
    assert seen["budget"] == (None if minutes is None else 60 * minutes)


def test_a_machine_too_slow_for_the_smallest_sizes_says_what_does_not_shrink():
    rate = 0.5 * _rate_for(STAGE2_FLOOR, DISTILL_FLOOR)
    decision = resize(rate, BUDGET_SECONDS, QUICK, OTHER)
    assert (decision.stage2_scale, decision.distill_scale) == (STAGE2_FLOOR, DISTILL_FLOOR)
    assert decision.predicted_after > BUDGET_SECONDS
    quick = DemoConfig.quick()
    line = budget.describe(decision, quick, budget.apply(quick, decision), 2, 2.0)
    assert "RESIZED Stage 2 120 -> 30 iterations, distillation 2 -> 0.5 epochs (48 -> 12 updates)" in line
    assert "still over the budget: the untrained steps (regeneration, extraction, evaluation...) alone take " in line
