"""make demo's time budget: a few-second GEMM probe, the prediction of each trained step from its FLOPs per
iteration, and the resize, a pure function of (rate, budget), that makes the prediction fit."""

import dataclasses
import json
import time

import pytest

from megatron_osprey.demo import budget
from megatron_osprey.demo.budget import (
    BUDGET_SECONDS,
    DISTILL_FLOOR,
    FIT_SHARE,
    STAGE2_FLOOR,
    TrainedStep,
    VllmEval,
    resize,
    scaled,
)
from megatron_osprey.demo.sizes import DemoConfig

FIT = FIT_SHARE * BUDGET_SECONDS  # what the resize fits the prediction to

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
        low, high = (middle, high) if _total(middle, s2, d) > FIT else (low, middle)
    return high


def test_a_fast_machine_keeps_the_sizes():
    decision = resize(1.01 * _rate_for(1.0, 1.0), BUDGET_SECONDS, QUICK, OTHER)
    assert not decision.resized and decision.predicted == decision.predicted_after <= FIT


def test_a_slower_machine_shortens_stage2_first_to_the_largest_size_that_fits():
    rate = (_rate_for(1.0, 1.0) * _rate_for(STAGE2_FLOOR, 1.0)) ** 0.5  # over budget, but Stage 2 can absorb it
    decision = resize(rate, BUDGET_SECONDS, QUICK, OTHER)
    assert decision.predicted > FIT and decision.resized and decision.concurrency is None  # nothing served here
    assert STAGE2_FLOOR < decision.stage2_scale < 1.0 and decision.distill_scale == 1.0
    assert decision.predicted_after <= FIT
    assert _total(rate, decision.stage2_scale, 1.0) == pytest.approx(decision.predicted_after)
    assert _total(rate, decision.stage2_scale + 0.01, 1.0) > FIT  # the largest that fits, to 1%


def test_a_much_slower_machine_also_shortens_distillation():
    rate = (_rate_for(STAGE2_FLOOR, 1.0) * _rate_for(STAGE2_FLOOR, 0.4)) ** 0.5
    decision = resize(rate, BUDGET_SECONDS, QUICK, OTHER)
    assert decision.stage2_scale == STAGE2_FLOOR and DISTILL_FLOOR < decision.distill_scale < 1.0
    assert decision.predicted_after <= FIT < _total(rate, STAGE2_FLOOR, decision.distill_scale + 0.01)


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


# The quick demo's evaluation in vLLM: the target alone, Osprey and EAGLE-3, 5 eval domains x 8 prompts x 32 tokens.
QUICK_VLLM = VllmEval(servers=3, splits=5, prompts=8, tokens=32, concurrency=(1, 4, 16))
OTHER_VLLM = budget.other_reference_seconds(96, vllm=True)
# The whole make demo the constants are fitted to (forced-AVX2 path, quiet machine, commit 61d672d): the probe's rate
# and each step's seconds as its report gave them.
MEASURED_RATE = 177.6
MEASURED = {
    "pretrain": 533,
    "regenerate": 114,
    "extract": 35,
    "distill_osprey": 289,
    "distill_eagle3": 110,
    "eval": 132,
    "eval_vllm": 779,
    "other": 71,
}


def test_the_quick_demo_serves_three_servers_on_every_eval_prompt():
    assert budget.demo_vllm_eval(DemoConfig.quick()) == QUICK_VLLM
    two = dataclasses.replace(DemoConfig.quick(), train_domains=("chat", "code"), vllm_concurrency=(1, 8))
    assert budget.demo_vllm_eval(two) == VllmEval(5, 5, 8, 32, (1, 8))


def test_the_vllm_evaluation_is_counted():
    rate = 100.0
    without = resize(rate, float("inf"), QUICK, OTHER_VLLM)
    served = resize(rate, float("inf"), QUICK, OTHER_VLLM, QUICK_VLLM)
    assert served.predicted - without.predicted == pytest.approx(QUICK_VLLM.seconds(rate))
    # 3 servers x (start-up + 5 splits x (256 + 2 x 32 x 1.66 + 32 x 2.54) decode steps), scaled by the rate
    by_hand = 3 * (budget.VLLM_STARTUP + 5 * 443.52 * budget.VLLM_DECODE_STEP_SECONDS) * budget.CALIBRATION_RATE / rate
    assert QUICK_VLLM.seconds(rate) == pytest.approx(by_hand, rel=1e-9)
    assert QUICK_VLLM.seconds(rate / 2) == pytest.approx(2 * QUICK_VLLM.seconds(rate))


def test_a_prediction_at_the_measured_rate_reproduces_the_measured_demo(smollm2_like):
    predicted = budget.predicted_steps(DemoConfig.quick(), smollm2_like, MEASURED_RATE, vllm=True)
    assert set(predicted) == set(MEASURED)
    for step, seconds in MEASURED.items():  # each step to 1% (the constants are rounded to 2-3 digits)
        assert predicted[step] == pytest.approx(seconds, rel=0.01), step
    assert sum(predicted.values()) == pytest.approx(2063, rel=0.005)  # 34.4 min against the measured 34.4
    steps = budget.demo_trained_steps(DemoConfig.quick(), smollm2_like, 96)
    decision = resize(MEASURED_RATE, BUDGET_SECONDS, steps, OTHER_VLLM, QUICK_VLLM)
    assert decision.predicted == pytest.approx(sum(predicted.values()))
    # Resized: the vLLM sweep to concurrency 1, then Stage 2, to 90% of the budget
    assert decision.concurrency == (1,) and 0.5 < decision.stage2_scale < 1.0 and decision.distill_scale == 1.0
    assert FIT - 10 < decision.predicted_after <= FIT


def test_shorter_sweeps_drop_the_inner_levels_then_the_highest_and_keep_the_lowest():
    assert budget.shorter_sweeps((1, 4, 16)) == [(1, 16), (1,)]
    assert budget.shorter_sweeps((8, 1, 2, 4)) == [(1, 2, 8), (1, 8), (1,)]
    assert budget.shorter_sweeps((1,)) == []
    assert QUICK_VLLM.seconds(100.0, (1, 16)) < QUICK_VLLM.seconds(100.0) and QUICK_VLLM.seconds(
        100.0, (1,)
    ) < QUICK_VLLM.seconds(100.0, (1, 16))


def test_the_resize_shortens_the_vllm_sweep_first_and_monotonically():
    full = _served_rate_for((1, 4, 16))
    rates = [full * f for f in (1.01, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.4, 0.2, 0.1)]
    decisions = [resize(r, BUDGET_SECONDS, QUICK, OTHER_VLLM, QUICK_VLLM) for r in rates]
    assert not decisions[0].resized
    kept = [d.concurrency or QUICK_VLLM.concurrency for d in decisions]
    seconds = [QUICK_VLLM.seconds(100.0, levels) for levels in kept]
    assert seconds == sorted(seconds, reverse=True) and kept[-1] == (1,)  # slower machine, shorter sweep
    assert (1, 16) in kept  # the middle level went first
    for d, levels in zip(decisions, kept):
        if d.stage2_scale < 1.0:  # Stage 2 is shortened only once the sweep is at its lowest level
            assert levels == (1,)
        assert d.predicted_after <= FIT or (d.stage2_scale, d.distill_scale) == (STAGE2_FLOOR, DISTILL_FLOOR)
    scales = [(d.stage2_scale, d.distill_scale) for d in decisions]
    assert scales == sorted(scales, reverse=True)


def _served_rate_for(levels):
    """The rate at which the quick demo, served in vLLM at concurrency `levels`, takes FIT at its sizes."""
    served = dataclasses.replace(QUICK_VLLM, concurrency=levels)
    low, high = 1e-3, 1e6
    for _ in range(100):
        middle = (low * high) ** 0.5
        predicted = resize(middle, float("inf"), QUICK, OTHER_VLLM, served).predicted
        low, high = (middle, high) if predicted > FIT else (low, middle)
    return high


def test_the_resized_sweep_reaches_the_eval_vllm_command(smollm2_like, tmp_path, monkeypatch):
    from pathlib import Path

    from megatron_osprey.demo.engine_eval import vllm_eval_argv
    from megatron_osprey.demo.report import _resized_lines
    from megatron_osprey.stages.cli import parse_config
    from megatron_osprey.stages.evaluate import FLAGS, EvaluateConfig

    quick = DemoConfig.quick()
    data = {"splits": {d: {"eval": Path(f"{d}.jsonl")} for d in quick.domains()}}
    drafters = [{"name": "osprey_chat", "path": "o", "domain": "chat", "method": "osprey"}]

    def levels(cfg):
        """The concurrency levels the eval_vllm step's command gives the evaluate stage, parsed as it parses them."""
        argv = vllm_eval_argv(cfg, smollm2_like, tmp_path / "out", drafters, data, "py", "ref.json")
        assert [str(w) for w in argv[:3]] == ["-m", "megatron_osprey", "evaluate"]
        config, _ = parse_config([str(w) for w in argv[3:]], "evaluate", EvaluateConfig, FLAGS, "", None)
        assert config.engine == "vllm"
        return config.vllm_concurrency

    assert levels(quick) == [1, 4, 16]  # as configured: the engine's own
    # Between the rates at which the full sweep and concurrency (1, 16) fit: only the sweep is shortened.
    rate = (_served_rate_for((1, 4, 16)) * _served_rate_for((1, 16))) ** 0.5
    monkeypatch.setattr(budget, "gemm_rate", lambda threads, seconds=2.0: rate)
    lines = []
    cfg = budget.fit_to_budget(quick, smollm2_like, tmp_path, BUDGET_SECONDS, 2, True, lines.append)
    assert (cfg.vllm_concurrency, cfg.backbone_iters, cfg.distill_epochs) == ((1, 16), 120, 2.0)
    assert levels(cfg) == [1, 16]
    assert "RESIZED vLLM eval concurrency 1 4 16 -> 1 16; predicted" in lines[0] and cfg.resized == lines[0]
    assert "vLLM was measured at concurrency 1 16 only" in _resized_lines(cfg)[0]
    # The measured rate: the sweep to concurrency 1 and Stage 2 shortened; a resumed run keeps both.
    monkeypatch.setattr(budget, "gemm_rate", lambda threads, seconds=2.0: MEASURED_RATE)
    measured = budget.fit_to_budget(quick, smollm2_like, tmp_path / "measured", BUDGET_SECONDS, 2, True, print)
    assert levels(measured) == [1] and measured.backbone_iters < 120
    again = budget.fit_to_budget(quick, smollm2_like, tmp_path / "measured", BUDGET_SECONDS, 2, True, print)
    assert again == measured
    # Without the engine nothing is served, so nothing of it is resized
    alone = budget.fit_to_budget(quick, smollm2_like, tmp_path / "alone", BUDGET_SECONDS, 2, False, print)
    assert alone.vllm_concurrency is None
