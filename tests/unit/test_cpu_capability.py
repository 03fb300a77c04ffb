"""The dtype follows what the CPU computes fast: float32 where it has no native bf16 (no avx512_bf16, no amx_bf16),
said in one line by `osprey plan`, the demo and the bench; the demo's long steps show progress with an ETA."""

from __future__ import annotations

import pytest

from megatron_osprey.base.hardware import CPU_CAPABILITY_ENV, CpuCapability, cpu_capability

# /proc/cpuinfo "flags" of the machines the issue names (trimmed to the flags that matter and a few neighbours).
EPYC_AVX2 = "processor\t: 0\nflags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c avx2 fma bmi2 sha_ni\n"
SKYLAKE_AVX512 = "flags\t\t: fpu sse2 avx avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni\n"
COOPER_LAKE = "flags\t\t: avx2 avx512f avx512bw avx512_vnni avx512_bf16\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8\n"


@pytest.mark.parametrize(
    "flags, isa, bf16, line",
    [
        (EPYC_AVX2, "AVX2", (), "CPU: AVX2, no native bf16: float32"),
        (SKYLAKE_AVX512, "AVX512", (), "CPU: AVX512, no native bf16: float32"),
        (COOPER_LAKE, "AVX512", ("avx512_bf16",), "CPU: AVX512 with bf16 (avx512_bf16)"),
        (SAPPHIRE_RAPIDS, "AVX512", ("avx512_bf16", "amx_bf16"), "CPU: AVX512 with bf16 (avx512_bf16, amx_bf16)"),
    ],
)
def test_the_capability_is_read_from_the_cpu_flags(tmp_path, flags, isa, bf16, line):
    (tmp_path / "cpuinfo").write_text(flags)
    cpu = cpu_capability({}, tmp_path / "cpuinfo")
    assert (cpu.isa, cpu.bf16_flags, cpu.native_bf16) == (isa, bf16, bool(bf16))
    assert cpu.compute_dtype == ("bfloat16" if bf16 else "float32")
    assert cpu.line().startswith(line)


def test_the_capability_can_be_forced_and_a_bad_name_is_one_line(tmp_path):
    (tmp_path / "cpuinfo").write_text(SAPPHIRE_RAPIDS)
    forced = cpu_capability({CPU_CAPABILITY_ENV: "AVX2"}, tmp_path / "cpuinfo")
    assert forced == CpuCapability("AVX2", (), CPU_CAPABILITY_ENV) and not forced.native_bf16
    assert forced.line().endswith(f"(forced by {CPU_CAPABILITY_ENV})")
    assert cpu_capability({CPU_CAPABILITY_ENV: "amx"}, tmp_path / "none").native_bf16
    with pytest.raises(ValueError, match=rf"^{CPU_CAPABILITY_ENV}='sse4' must be one of avx2, avx512, avx512_bf16"):
        cpu_capability({CPU_CAPABILITY_ENV: "sse4"})
    # No /proc/cpuinfo (macOS, Windows): nothing says bf16 is native, so float32.
    assert cpu_capability({}, tmp_path / "none").compute_dtype == "float32"


@pytest.mark.parametrize("forced, bf16", [("avx2", False), ("avx512_bf16", True)])
def test_the_demo_computes_in_float32_without_native_bf16_and_says_so(monkeypatch, capsys, tmp_path, forced, bf16):
    import megatron_osprey.demo.__main__ as demo
    import megatron_osprey.demo.pipeline as pipeline
    from megatron_osprey.demo.commands import pretrain_argv

    seen = {}

    def record(cfg, output, fresh=False, **engine):  # engine: where vLLM is looked for
        seen["cfg"] = cfg
        raise RuntimeError("stopped after the config")

    monkeypatch.setattr(pipeline, "run_demo", record)
    monkeypatch.setenv(CPU_CAPABILITY_ENV, forced)
    assert demo.main(["--smoke", "--output", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert seen["cfg"].bf16 is bf16
    assert ("CPU: AVX2, no native bf16: float32" in out) is not bf16 and ("with bf16" in out) is bf16
    argv = pretrain_argv(seen["cfg"], "--backbone", tmp_path, tmp_path, tmp_path, 120, 1e-3)
    assert ("--bf16" in argv) is bf16
    assert argv[argv.index("--log-interval") + 1] == "5"  # a line every 5 of 120 iterations, for the ETA


def test_osprey_plan_names_the_cpu_of_a_cpu_recipe_only():
    from launcher.plan import make_plan
    from megatron_osprey.recipes import get_recipe

    avx2 = CpuCapability("AVX2")
    lines = make_plan(get_recipe("tiny_cpu_backbone_pretrain_2proc_fp32"), "pretrain", cpu=avx2).lines()
    assert "hardware CPU: AVX2, no native bf16: float32 (bf16 would be emulated, tens of times slower)" in lines
    gpu = make_plan(get_recipe("qwen3_4b_backbone_pretrain_10k_64gpu_h100_bf16"), "pretrain", cpu=avx2)
    assert gpu.cpu is None and not any(line.startswith("hardware") for line in gpu.lines())


def test_a_slow_step_shows_iterations_with_an_eta_and_a_heartbeat(tmp_path, capsys):
    """A training step whose iteration lines are sparse, then a long silent stretch: every line that reaches the
    screen within the heartbeat says where the step is."""
    from megatron_osprey.demo.step_runner import StepRunner, eta_text

    script = tmp_path / "slow_step.py"
    script.write_text(
        "import time\n"
        "for i in range(1, 5):\n"
        "    print(f'iteration {i:>7d}/8 | loss/train: 1.0 | optim/lr: 0.1', flush=True)\n"
        "    time.sleep(0.2)\n"
        "print('setting up the next phase', flush=True)\n"
        "time.sleep(1.6)\n"
        "print('iteration       8/8 | loss/train: 0.5 | optim/lr: 0.1', flush=True)\n"
    )
    runner = StepRunner(tmp_path / "out", total_steps=1)
    runner.progress_every, runner.heartbeat_after = 0.3, 0.7
    runner.run("slow", [str(script)])
    lines = capsys.readouterr().out.splitlines()
    iterations = [line for line in lines if line.strip().startswith("iteration")]
    assert iterations[0].strip().startswith("iteration       1/8") and "| ETA" in iterations[0]
    assert iterations[-1].strip().startswith("iteration       8/8") and iterations[-1].endswith("| ETA 0s")
    assert len(iterations) < 5  # throttled: not every logged iteration reaches the screen
    heartbeat = [line for line in lines if "slow: still running" in line]
    assert heartbeat and heartbeat[0].endswith("last output: setting up the next phase")
    assert eta_text(120.0, 20, 120) == "ETA 10.0 min" and eta_text(10.0, 5, 10) == "ETA 10s"
