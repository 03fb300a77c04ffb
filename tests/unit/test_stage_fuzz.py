"""Every stage's argument parser, driven with random and hostile flag values: exit 2 and one `error:` line, never a
traceback. Seeded, so a failure reproduces; the paths point nowhere, so no case starts real work."""

from __future__ import annotations

import importlib
import random

import pytest

from megatron_osprey.recipes import STAGES
from megatron_osprey.recipes.registry import stage_resolver

HOSTILE = [
    "",
    "-1",
    "0",
    "nan",
    "inf",
    "-inf",
    "1e999",
    "3.5",
    "ten",
    "'; rm -rf ~ #",
    "$(reboot)",
    "line\nbreak",
    "../../../etc/passwd",
    "http://user:secret@host:9/?token=SECRET",
    "\x00",
    "🦅",
]
CASES_PER_STAGE = 12


def _flags(module) -> list:
    return [flag for group in module.FLAGS.values() for flag in group]


def _argv(rng: random.Random, module, tmp_path) -> list[str]:
    """A missing input everywhere a path goes, then a few flags set to hostile values."""
    argv = []
    flags = _flags(module)
    for flag in rng.sample(flags, k=min(len(flags), rng.randint(1, 4))):
        action = flag.kwargs.get("action")
        if action in ("store_true", "store_false"):
            argv.append(flag.flag)
            continue
        nargs = flag.kwargs.get("nargs")
        count = nargs if isinstance(nargs, int) else 1
        argv += [flag.flag, *(rng.choice(HOSTILE) for _ in range(count))]
    return argv


def _base(stage: str, tmp_path) -> list[str]:
    """Flags that make the stage reach its own checks: every input path missing."""
    missing = str(tmp_path / "missing")
    return {
        "prune": ["--source", missing, "--output", str(tmp_path / "out")],
        "preprocess": ["--input", missing, "--tokenizer", missing, "--output-prefix", str(tmp_path / "p")],
        "pretrain": ["--backbone", missing, "--data-path", missing, "--train-iters", "2"],
        "adapt": ["--backbone", missing, "--target", missing, "--output", str(tmp_path / "out")],
        "regenerate": ["--input", missing, "--output", str(tmp_path / "o.jsonl"), "--server-url", "http://127.0.0.1:9"],
        "extract": ["--target", missing, "--data", missing, "--output", str(tmp_path / "store")],
        "rollout": ["--target", missing, "--drafter", missing, "--data", missing, "--output", str(tmp_path / "out")],
        "distill": ["--drafter-init", missing, "--target", missing, "--data-path", missing, "--train-iters", "2"],
        "export": ["--checkpoint", missing, "--output", str(tmp_path / "out")],
        "evaluate": ["--target", missing, "--drafter", f"d={missing}", "--data", missing, "--output", missing],
        "data": ["--input", f"code={missing}", "--target", missing, "--output", str(tmp_path / "out")],
        "ngram": ["--input", missing, "--tokenizer", missing, "--output", str(tmp_path / "out")],
        "suite": ["--suite", "humaneval", "--source", missing, "--output", str(tmp_path / "o.jsonl")],
    }[stage]


# The chain's stages, and the stages no recipe chain runs (osprey data, the n-gram drafter, osprey suite).
@pytest.mark.parametrize("stage", [*STAGES, "data", "ngram", "suite"])
def test_hostile_flags_exit_2_with_one_error_line(stage, tmp_path, capsys):
    module = importlib.import_module(f"megatron_osprey.stages.{stage}")
    rng = random.Random(f"fuzz:{stage}")
    for case in range(CASES_PER_STAGE):
        argv = _base(stage, tmp_path) + _argv(rng, module, tmp_path)
        if case % 4 == 0:  # a bad --set key, a bad type, a section, null
            argv += ["--set", rng.choice(["training.nope=3", "nope.x=1", "parallel=1", "ttt.ttt_steps=ten"])]
        try:
            code = module.main(argv, recipes=stage_resolver)
        except SystemExit as exit_:  # argparse's own refusal
            code = exit_.code
        err = capsys.readouterr().err
        assert code == 2, (stage, argv, err[-1500:])
        assert "Traceback" not in err, (stage, argv, err[-1500:])
        errors = [line for line in err.splitlines() if "error:" in line]
        assert len(errors) == 1, (stage, argv, err[-1500:])


def test_a_frozen_section_takes_its_flag():
    # --enable-thinking sets a field of the frozen sampling parameters: it must be replaced, not mutated.
    from megatron_osprey.stages.cli import parse_config
    from megatron_osprey.stages.regenerate import FLAGS, RegenerateConfig

    config, _ = parse_config(["--enable-thinking", "--temperature", "0.5"], "regenerate", RegenerateConfig, FLAGS, "")
    assert config.sampling.enable_thinking is True and config.sampling.temperature == 0.5
