"""The demo's sizes: what `make demo`, `--smoke` and `--cross-tokenizer` select."""

import dataclasses

import pytest

from megatron_osprey.demo.sizes import DemoConfig, SmallLM
from megatron_osprey.losses.config import TTTLossConfig


def test_cross_tokenizer_arm_is_added_to_any_size_and_scaled_to_it():
    smoke = DemoConfig.smoke().with_cross_tokenizer()
    assert smoke.cross_tokenizer == SmallLM(iters=5 * DemoConfig.smoke().backbone_iters)
    assert DemoConfig.quick().cross_tokenizer is None
    assert DemoConfig.quick().with_cross_tokenizer().cross_tokenizer.iters == 300
    full = DemoConfig.full()
    assert full.with_cross_tokenizer() is full and full.cross_tokenizer == SmallLM()


def test_quick_keeps_the_paper_protocol_and_holds_out_every_eval_domain():
    quick = DemoConfig.quick()
    # No TTT override: every arm trains with the TTT loss's own default, the paper's K=5.
    assert quick.ttt_steps is None and TTTLossConfig().ttt_steps == 5 and quick.draft_vocab_fraction == 0.25
    assert set(quick.train_domains) < set(quick.eval_domains)  # the rest are out of domain
    assert len(quick.eval_domains) == 5


def test_full_meets_the_issue_minimums_and_replays_with_a_live_check():
    full = DemoConfig.full()
    assert len(full.train_domains) >= 2 and len(full.seeds) >= 3 and full.cross_tokenizer is not None
    assert full.n_eval >= 32 and full.eval_tokens >= 128
    assert full.eval_replay and 0 < full.live_check_prompts <= full.n_eval
    assert not DemoConfig.quick().eval_replay  # make demo decodes live, lossless-checked


def test_live_check_compares_live_requests_with_the_replayed_ones(tmp_path):
    import json

    from megatron_osprey.demo.report import live_check

    def request(rid, accept, tokens):
        return {
            "id": rid,
            "accept_lengths": accept,
            "output_ids": tokens,
            "completion_tokens": len(tokens),
            "seconds": 1.0,
            "target_seconds": 0.5,
        }

    replayed = {
        "config": {"replay": True, "batch_size": 4},
        "cells": [
            {
                "drafter": "a",
                "method": "osprey",
                "split": "code",
                "requests": [request("c0", [2, 1], [5, 6, 7]), request("c1", [1, 1], [8, 9, 1])],
            }
        ],
    }
    live = {
        "config": {"batch_size": 4},
        "lossless": {"mismatches": [{"id": "c1"}]},
        "cells": [
            {
                "drafter": "a",
                "method": "osprey",
                "split": "code",
                "requests": [request("c0", [2, 1], [5, 6, 7]), request("c1", [2], [8, 9, 2])],
            }
        ],
    }
    path = tmp_path / "live.json"
    path.write_text(json.dumps(live))
    check = live_check(replayed, path)
    assert (check["requests"], check["same_as_replay"], check["lossless_mismatches"]) == (2, 1, 1)
    assert check["speed"]["target_only_tokens_per_s"] == 6 / 1.0
    assert live_check({**replayed, "config": {}}, path) is None and live_check(replayed, tmp_path / "no") is None


def test_a_resumed_run_reports_the_seconds_of_the_steps_it_skipped(tmp_path):
    from megatron_osprey.demo.report import _time_line
    from megatron_osprey.demo.step_runner import StepRunner

    first = StepRunner(tmp_path, total_steps=1)
    first.run("noop", ["-c", "pass"])
    assert first.earlier == {} and "noop" in first.timings
    resumed = StepRunner(tmp_path, total_steps=1)
    resumed.run("noop", ["-c", "pass"])  # same command: skipped, its recorded seconds kept
    resumed.run("other", ["-c", "pass"])
    assert set(resumed.earlier) == {"noop"} and set(resumed.timings) == {"other"}
    assert resumed.earlier["noop"] == round(first.timings["noop"], 1)
    changed = StepRunner(tmp_path, total_steps=1)
    assert changed.finished("noop", ["-c", "pass"]) == resumed.earlier["noop"]
    assert changed.finished("noop", ["-c", "pass", "x"]) is None and changed.earlier == {}  # another command reruns
    line = _time_line({"seconds": 60.0, "step_seconds": {"other": 30.0}, "earlier_step_seconds": {"noop": 90.0}})
    assert "Resumed: 1 steps finished in earlier runs" in line and "all steps together took 2.0 min" in line
    assert "Resumed" not in _time_line({"seconds": 60.0, "step_seconds": {"other": 30.0}})


def test_a_step_recorded_before_the_job_door_still_counts_as_finished(tmp_path):
    # Runs recorded `-m megatron_osprey.stages.STAGE`; the door spells the same step `-m megatron_osprey STAGE`.
    import json

    from megatron_osprey.demo.step_runner import StepRunner

    steps = StepRunner(tmp_path, total_steps=1)
    old = ["-m", "megatron_osprey.stages.data", "--input", "chat=x.jsonl", "--seed", "0"]
    (steps.done / "data.json").write_text(json.dumps({"command": old, "seconds": 12.5}))
    assert steps.finished("data", ["-m", "megatron_osprey", "data", "--input", "chat=x.jsonl", "--seed", "0"]) == 12.5
    assert steps.finished("data", ["-m", "megatron_osprey", "data", "--input", "chat=x.jsonl", "--seed", "1"]) is None
    assert steps.finished("data", ["-m", "megatron_osprey", "ngram", "--input", "chat=x.jsonl", "--seed", "0"]) is None


def test_speed_names_the_batch_that_really_ran():
    from megatron_osprey.demo.report import speed

    def cell(method, n):
        return {"method": method, "requests": [{"completion_tokens": 8, "seconds": 1.0, "target_seconds": 0.5}] * n}

    results = {"config": {"batch_size": 32}, "cells": [cell("osprey", 4), cell("eagle3", 4)]}
    out = speed(results)  # 4 requests per cell decode 4 at a time, whatever --batch-size allows
    assert out["batch_size"] == 4 and out["speculative_tokens_per_s"] == {"osprey": 8.0, "eagle3": 8.0}
    assert out["target_only_tokens_per_s"] == 16.0
    results["cells"] = [cell("osprey", 40)]
    assert speed(results)["batch_size"] == 32


class _Recorder:
    """A StepRunner stand-in that records each step's command instead of running it."""

    def __init__(self):
        self.commands = {}

    def run(self, name, argv, torchrun=0):
        self.commands[name] = [str(a) for a in argv]


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_regeneration_samples_at_the_release_temperature_seeded_and_greedy_is_an_option(tmp_path):
    from megatron_osprey.demo.arms import regenerate_and_extract

    data = {"splits": {"chat": {"train": tmp_path / "chat.jsonl"}}}
    default = DemoConfig.smoke()
    assert default.regenerate_temperature == 1.0
    for cfg, temperature in ((default, 1.0), (dataclasses.replace(default, regenerate_temperature=0.0, seed=7), 0.0)):
        steps = _Recorder()
        regenerate_and_extract(steps, cfg, tmp_path, data, tmp_path / "target")
        argv = steps.commands["regenerate_chat"]
        assert float(_flag(argv, "--temperature")) == temperature and _flag(argv, "--seed") == str(cfg.seed)
        assert _flag(argv, "--input") == str(tmp_path / "chat.jsonl")


def test_the_demo_regenerates_in_vllm_where_the_engine_is_installed(tmp_path):
    from megatron_osprey.demo.arms import regenerate_and_extract

    data = {"splits": {"chat": {"train": tmp_path / "chat.jsonl"}}}
    engine = tmp_path / "vllm-python"
    engine.write_text("#!/bin/sh\necho 0.32.0\n")  # what `import vllm; print(vllm.__version__)` prints there
    engine.chmod(0o755)
    served, in_process = _Recorder(), _Recorder()
    regenerate_and_extract(served, DemoConfig.smoke(), tmp_path, data, tmp_path / "target", vllm_python=str(engine))
    argv = served.commands["regenerate_chat"]
    assert _flag(argv, "--serve") == "vllm" and _flag(argv, "--vllm-python") == str(engine)
    assert "--backend" not in argv and _flag(argv, "--model") == str(tmp_path / "target")
    # No engine there: the target runs in-process, batched, as before.
    regenerate_and_extract(in_process, DemoConfig.smoke(), tmp_path, data, tmp_path / "target", str(tmp_path / "no"))
    argv = in_process.commands["regenerate_chat"]
    assert _flag(argv, "--backend") == "hf" and _flag(argv, "--batch-size") == "16" and "--serve" not in argv


def test_the_demo_flag_sets_the_regeneration_temperature(monkeypatch, tmp_path):
    import megatron_osprey.demo.pipeline as pipeline
    from megatron_osprey.demo.__main__ import main

    seen = []

    def fake_run_demo(cfg, output, fresh=False, **engine):
        seen.append(cfg)
        (output / "report.md").write_text("")
        return {}

    monkeypatch.setattr(pipeline, "run_demo", fake_run_demo)
    assert main(["--smoke", "--output", str(tmp_path)]) == 0
    assert main(["--smoke", "--output", str(tmp_path), "--regenerate-temperature", "0"]) == 0
    assert [c.regenerate_temperature for c in seen] == [1.0, 0.0]
    assert dataclasses.replace(seen[1], regenerate_temperature=1.0) == seen[0] == DemoConfig.smoke()
    with pytest.raises(SystemExit):
        main(["--smoke", "--output", str(tmp_path), "--regenerate-temperature", "-1"])


def test_the_data_step_is_osprey_data_on_the_user_files(tmp_path):
    from megatron_osprey.demo.commands import user_data_argv

    cfg = DemoConfig.smoke()
    files = {d: tmp_path / "raw" / f"{d}.jsonl" for d in cfg.domains()}
    argv = user_data_argv(cfg, files, tmp_path / "target", tmp_path / "user")
    assert argv[:3] == ["-m", "megatron_osprey", "data"]
    inputs = [argv[i + 1] for i, word in enumerate(argv) if word == "--input"]
    assert inputs == [f"chat={files['chat']}", f"math={files['math']}"]
    assert _flag(argv, "--eval-size") == str(cfg.n_eval) and _flag(argv, "--seed") == str(cfg.seed)
    assert _flag(argv, "--output") == tmp_path / "user"
