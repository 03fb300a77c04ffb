"""The demo's real-engine step and report section, without the engine: which drafters it serves, the command it
runs, the one line when no engine is installed, and the table when one is."""

import json
from pathlib import Path

import pytest

from megatron_osprey.demo import engine_eval
from megatron_osprey.demo.sizes import DemoConfig


class RecordingSteps:
    def __init__(self):
        self.ran = []

    def run(self, name, argv, torchrun=0):
        self.ran.append((name, [str(a) for a in argv]))


def _drafters(tmp_path, seeds=(0,)):
    return [
        {"name": f"{m}_chat_s{s}", "method": m, "domain": "chat", "seed": s, "path": tmp_path / f"{m}{s}"}
        for s in seeds
        for m in ("osprey", "eagle3")
    ]


def _data(tmp_path, cfg):
    return {"splits": {d: {"eval": tmp_path / f"{d}.jsonl"} for d in cfg.domains()}}


def test_without_an_engine_the_step_says_so_in_one_line_and_runs_nothing(tmp_path, monkeypatch):
    cfg, steps = DemoConfig.smoke(), RecordingSteps()
    missing = str(tmp_path / "no-python")
    info = engine_eval.serve_in_vllm(
        steps, cfg, tmp_path, tmp_path / "eval", _drafters(tmp_path), _data(tmp_path, cfg), tmp_path, missing, True
    )
    assert steps.ran == [] and set(info) == {"skipped"}
    assert "make engine-vllm" in info["skipped"] and "\n" not in info["skipped"]
    lines = engine_eval.render_vllm(engine_eval.vllm_report(info))
    assert lines == ["", f"Real serving engine (vLLM): {info['skipped']}"]
    assert engine_eval.serve_in_vllm(steps, cfg, tmp_path, tmp_path, [], {}, tmp_path, None, False)["skipped"]


def test_with_an_engine_seed_zeros_servable_drafters_go_beside_the_reference_results(tmp_path, monkeypatch):
    cfg = DemoConfig.smoke()
    cfg = DemoConfig(**{**cfg.__dict__, "seeds": (0, 1)})
    steps = RecordingSteps()
    monkeypatch.setattr(
        "megatron_osprey.eval.vllm_engine.engine_or_reason", lambda p, env, repo: ("/venv/python", None)
    )
    refusals = {"osprey0": "needs `export --format vllm`"}
    monkeypatch.setattr(engine_eval, "drafter_refusal", lambda path: refusals.get(Path(path).name))
    info = engine_eval.serve_in_vllm(
        steps,
        cfg,
        tmp_path / "target",
        tmp_path / "eval",
        _drafters(tmp_path, (0, 1)),
        _data(tmp_path, cfg),
        tmp_path,
        None,
        True,
    )
    assert info == {
        "results": str(tmp_path / "eval_vllm" / "results.json"),
        "not_served": {"osprey_chat_s0": refusals["osprey0"]},
    }
    [(name, argv)] = steps.ran
    assert name == "eval_vllm"
    flags = dict(zip(argv, argv[1:]))
    assert flags["--engine"] == "vllm" and flags["--vllm-python"] == "/venv/python"
    assert flags["--reference-results"] == str(tmp_path / "eval" / "results.json")
    assert flags["--output"] == str(tmp_path / "eval_vllm") and flags["--max-new-tokens"] == str(cfg.eval_tokens)
    drafters = [argv[i + 1] for i, a in enumerate(argv) if a == "--drafter"]
    assert drafters == [f"eagle3_chat_s0={tmp_path / 'eagle30'}"]


@pytest.mark.parametrize("kv, shown", [(1 << 30, "KV cache 1024 MiB"), (None, "KV cache vLLM's share of the memory")])
def test_the_report_table_has_both_engines_al_mismatches_and_speed_per_concurrency(tmp_path, kv, shown):
    speeds = {str(c): {"tokens_per_s": 10.0 * c, "speedup": 0.5, "in_flight": c} for c in (1, 4, 16)}
    split = {
        "acceptance_length": 1.151,
        "reference_acceptance_length": 1.143,
        "lossless_mismatches": [],
        "concurrency": speeds,
    }
    section = {
        "engine": {
            "version": "0.32.0",
            "device": "cpu",
            "enforce_eager": True,
            "kv_cache_memory_bytes": kv,  # None: a GPU server's own share
            "ld_preload": "libiomp5.so",
            "num_speculative_tokens": 5,
            "concurrency": [1, 4, 16],
        },
        "drafters": {
            "eagle3_chat": {
                "acceptance_length": 1.151,
                "reference_acceptance_length": 1.143,
                "speedup": speeds,
                "splits": {"chat": split, "math": split},
            }
        },
        "agreement": {"tolerance": 0.04, "failures": []},
    }
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"vllm": section}))
    report = engine_eval.vllm_report({"results": str(results), "not_served": {"osprey_chat": "no plugin"}})
    json.dumps(report)
    text = "\n".join(engine_eval.render_vllm(report))
    assert "## In a real serving engine: vLLM beside the reference engine" in text
    assert "| eagle3_chat | chat | 1.151 | 1.143 | 0 | 10.0 (0.50x) | 40.0 (0.50x) | 160.0 (0.50x) |" in text
    assert "| eagle3_chat | **all** |" in text and "every drafter agrees" in text
    assert f"enforce_eager, {shown}, LD_PRELOAD libiomp5.so" in text
    assert "Not served in vLLM: osprey_chat (no plugin)." in text


@pytest.mark.parametrize("aux", [[1, 3, 5], [1, 5]])
def test_a_demo_drafters_kind_comes_from_its_run_config_without_loading_weights(tmp_path, aux, monkeypatch):
    """The refusal is the export's own (layouts.vllm_refusal), on the config read from run_config.yaml alone."""
    from megatron_osprey.eval import loading
    from megatron_osprey.models.drafter.reference import DrafterConfig

    seen = {}
    monkeypatch.setattr(loading, "is_megatron_checkpoint", lambda path: True)
    drafter = {"variant": "osprey", "num_layers": 2}
    monkeypatch.setattr(loading, "megatron_run_config", lambda path: {"drafter": drafter})
    config = DrafterConfig(
        hidden_size=32, target_hidden_size=24, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=48, vocab_size=120, draft_vocab_size=90, aux_layer_ids=aux, variant="osprey",
    )  # fmt: skip

    class Arch:
        @classmethod
        def from_dict(cls, data):
            seen["data"] = data
            return cls()

        def reference_config(self):
            return config

    monkeypatch.setattr("megatron_osprey.models.drafter.arch.DrafterArch", Arch)
    refusal = engine_eval.drafter_refusal(tmp_path)
    assert seen["data"] == drafter
    assert (refusal is None) == (len(aux) == 3)
    if refusal:
        assert refusal.startswith("--format vllm: aux_layer_ids [1, 5] must name three target layers")
