"""The demo's pipeline end to end at the smallest size on the real target (SmolLM2-135M-Instruct), every
entry point in order, on CPU; then checks that its report is what its results say, and that distillation
did something."""

import json
import subprocess
import sys

import numpy as np
import pytest

from megatron_osprey.demo.pipeline import MARKER, run_demo
from megatron_osprey.demo.sizes import DemoConfig
from megatron_osprey.demo.step_runner import ROOT


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    output = tmp_path_factory.mktemp("demo")
    cfg = DemoConfig.smoke()
    return output, cfg, run_demo(cfg, output)


def _recompute(results: dict) -> dict:
    """Mean / ID / OOD AL per method straight from results.json's per-request records (one seed)."""
    cells = {}
    for cell in results["cells"]:
        als = [r["completion_tokens"] / max(r["verify_count"], 1) for r in cell["requests"]]
        cells.setdefault(cell["method"], {})[(cell["train_domain"], cell["split"])] = float(np.mean(als))
    out = {}
    for method, by_cell in cells.items():
        ids = [v for (t, s), v in by_cell.items() if t == s]
        oods = [v for (t, s), v in by_cell.items() if t != s]
        out[method] = {
            "mean": float(np.mean(list(by_cell.values()))),
            "id": float(np.mean(ids)),
            "ood": float(np.mean(oods)),
        }
    return out


def test_report_equals_a_recomputation_from_results(demo):
    output, cfg, report = demo
    on_disk = json.loads((output / "report.json").read_text())
    results = json.loads((output / "eval" / "results.json").read_text())
    assert on_disk["methods"].keys() == {"osprey", "eagle3"}
    recomputed = _recompute(results)
    for method, stats in recomputed.items():
        for key in ("mean", "id", "ood"):
            assert on_disk["methods"][method][key] == pytest.approx(stats[key], abs=1e-12)
    gain = on_disk["osprey_gain_over_eagle3"]["mean"]
    assert gain == pytest.approx(recomputed["osprey"]["mean"] / recomputed["eagle3"]["mean"] - 1, abs=1e-12)
    for method in ("osprey", "eagle3"):
        matrix = on_disk["matrix"][method]
        assert matrix["train_domains"] == list(cfg.train_domains)
        assert matrix["eval_domains"] == list(cfg.eval_domains)
        assert all(1.0 <= v <= 6.0 for v in matrix["acceptance_length"][0])  # 1 <= AL <= draft tokens
    assert on_disk["lossless"] == {"checked": True, "mismatches": 0}
    # The EAGLE-3 arm's draft vocabulary is 25% of the target's, and its coverage is reported per domain.
    coverage = on_disk["draft_vocab_coverage"]["eagle3_chat"]
    assert coverage["draft_vocab_size"] == 12_288
    assert set(coverage["coverage"]) == set(cfg.eval_domains)
    assert (output / "heatmap.png").stat().st_size > 1000
    text = (output / "report.md").read_text()
    assert f"{on_disk['methods']['osprey']['mean']:.3f}" in text and "self-drafting" in text


def test_every_stage_ran_through_its_entry_point(demo):
    output, cfg, _ = demo
    logs = sorted(p.name for p in (output / "logs").iterdir())
    for step in (
        "data",
        "prune_target",
        "pretrain_backbone_target",
        "adapt_target",
        "regenerate_chat",
        "extract_chat",
        "distill_osprey_chat",
        "distill_eagle3_chat",
        "eval",
    ):
        assert f"{step}.log" in logs, step
    assert (output / "backbone_target" / "hf" / "config.json").is_file()  # Stage 2 left the Stage 3 layout
    assert (output / "drafter_init_target" / "tokenizer_alignment.json").is_file()
    assert (output / "stores" / "chat" / "manifest.json").is_file()  # one store, read by both arms
    assert (output / MARKER).is_file()
    regenerated = (output / "data" / "chat_regenerated.jsonl").read_text().splitlines()
    assert len(regenerated) == cfg.n_train
    # osprey data split the user's files; regeneration read its training prompts and sampled at T=1.0, seeded.
    summary = json.loads((output / "data" / "user" / "data_summary.json").read_text())["domains"]
    assert {d: (c["train"], c["eval"]) for d, c in summary.items()} == {
        d: (cfg.n_train, cfg.n_eval) for d in cfg.domains()
    }
    regenerate = json.loads((output / ".steps" / "regenerate_chat.json").read_text())["command"]
    flags = dict(zip(regenerate, regenerate[1:]))
    assert flags["--input"] == str(output / "data" / "user" / "prompts" / "chat.jsonl")
    assert (float(flags["--temperature"]), flags["--seed"]) == (1.0, str(cfg.seed))


def test_a_rerun_resumes_without_redoing_finished_steps(demo, capsys):
    output, cfg, report = demo
    again = run_demo(cfg, output)
    printed = capsys.readouterr().out
    assert printed.count("finished in an earlier run, skipped") >= 8
    assert again["methods"] == report["methods"]


def test_distilled_drafter_beats_an_untrained_one(demo, tmp_path):
    """The trained EAGLE-3 drafter accepts more than the same architecture at init (one step at lr 1e-12, as
    --lr must be > 0) on the same prompts."""
    from megatron_osprey.eval.config import DrafterSpec
    from megatron_osprey.eval.run import run_eval
    from megatron_osprey.stages.evaluate import EvaluateConfig

    output, cfg, _ = demo
    log = json.loads((output / ".steps" / "distill_eagle3_chat.json").read_text())["command"]
    argv = list(log)
    for flag, value in (
        ("--train-iters", "1"),
        ("--lr", "1e-12"),
        ("--min-lr", "0"),
        ("--save-interval", "1"),
        ("--save", str(tmp_path / "untrained")),
    ):
        argv[argv.index(flag) + 1] = value
    subprocess.run([sys.executable, *argv], cwd=ROOT, check=True, capture_output=True)
    target = json.loads((output / "report.json").read_text())["target"]
    results = run_eval(
        EvaluateConfig(
            target=str(target),
            output=str(tmp_path / "eval"),
            data=[str(output / "data" / "user" / "eval" / f"{d}.jsonl") for d in cfg.eval_domains],
            drafters=[
                DrafterSpec("trained", output / "drafters" / "eagle3_chat"),
                DrafterSpec("untrained", tmp_path / "untrained"),
            ],
            max_new_tokens=cfg.eval_tokens,
            progress=False,
        ).resolved()  # what the evaluate stage runs: every drafter named, the required fields checked
    )
    al = {}
    for cell in results["cells"]:
        al.setdefault(cell["drafter"], []).extend(r["acceptance_length"] for r in cell["requests"])
    assert np.mean(al["trained"]) > np.mean(al["untrained"]) + 0.02, al


def test_refuses_a_directory_it_did_not_write(tmp_path):
    (tmp_path / "precious.txt").write_text("keep")
    with pytest.raises(RuntimeError, match="was not written by the demo"):
        run_demo(DemoConfig.smoke(), tmp_path)
    assert (tmp_path / "precious.txt").read_text() == "keep"


# Every extra arm at smoke size, on a worker that shares two cores with the other: more than pytest's 900 s default
# when the machine is loaded (the online Draft-OPD arm rolls out with the HF target each round).
@pytest.mark.timeout(1800)
def test_extra_arms_resume_the_run_and_are_reported(demo, capsys):
    """Every extra arm added to the finished run: only the new steps run, each arm is evaluated (lossless),
    compared with its base arm, and the harder sets and n-gram drafters are reported."""
    from megatron_osprey.demo.commands import opd_updates
    from megatron_osprey.demo.extra_arms import FIRST_GROUP, OFFLINE_ARMS, OTHER_NEURAL_ARMS, eval_group
    from megatron_osprey.demo.report_arms import COMPARISONS
    from megatron_osprey.demo.sizes import EXTRA_ARMS

    output, cfg, _ = demo
    arms = cfg.with_arms(["all"])
    report = run_demo(arms, output)
    printed = capsys.readouterr().out
    for step in ("pretrain_backbone_target", "regenerate_chat", "extract_chat", "distill_osprey_chat"):
        assert f"{step}: finished in an earlier run, skipped" in printed
    neural = set(OFFLINE_ARMS) | set(OTHER_NEURAL_ARMS)
    assert set(report["methods"]) == {"osprey", "eagle3"} | neural
    assert {(r["arm"], r["base"]) for r in report["arms"]["comparisons"]} == {(a, b) for a, b, _ in COMPARISONS}
    harder = report["arms"]["harder"]  # the first evaluation group's arms (the TTT-depth arms: eval domains only)
    first = {m for m in neural if eval_group(m) == FIRST_GROUP} | {"osprey", "eagle3"}
    assert first < neural | {"osprey", "eagle3"} and set(harder) == {f"{m}_chat" for m in first}
    assert all(set(e["al"]) == {"chat.perturbed", "chat.long_context", "translation", "story"} for e in harder.values())
    assert set(report["arms"]["ngram"]) == {"ngram_chat", "ngram_monolingual_multilingual"}
    assert set(report["arms"]["suites"]) == set(harder) and all(
        set(e["al"]) == {"humaneval"} for e in report["arms"]["suites"].values()
    )
    for name in ("eval", "eval/harder", "eval/suites", "eval/ngram", "eval/ngram_harder"):
        lossless = json.loads((output / name / "results.json").read_text())["lossless"]
        assert lossless == {"checked": True, "mismatches": []}, name
    # Draft-OPD's online loop took opd_updates updates (its SFT control as many more); the n-gram drafters report
    # their drafting cost.
    assert (output / "drafters" / "osprey_opd_chat" / "latest_checkpointed_iteration.txt").read_text().strip() == str(
        opd_updates(arms)
    )
    assert all(v is not None for e in report["arms"]["ngram"].values() for v in e["draft_us"].values())
    text = (output / "report.md").read_text()
    assert "Extra arms against the arm each one changes" in text and "N-gram drafters" in text
    assert "Public benchmarks" in text
    assert all(EXTRA_ARMS[m] in text for m in neural)
    _drift_norms_per_chain_step(output)


def _drift_norms_per_chain_step(output):
    """The attention-drift measurement on the trained demo drafters (benchmarks/drift_norms.py): EAGLE-3 hands
    its residual stream from chain step to step; with --hidden-post-norm it hands the final norm's output, whose
    size the norm's weight bounds at every step, however far the chain runs past the 5 steps it trained."""
    import torch

    from megatron_osprey.data.hidden_state_store import HiddenStateStore
    from megatron_osprey.eval.loading import load_drafter

    sys.path.insert(0, str(ROOT))
    from benchmarks.drift_norms import step_norms

    store = HiddenStateStore(output / "stores" / "chat", dtype=torch.float32)
    plain = load_drafter(output / "drafters" / "eagle3_chat").drafter.float()
    drift = load_drafter(output / "drafters" / "eagle3_drift_chat").drafter.float()
    assert not plain.config.hidden_post_norm and drift.config.hidden_post_norm
    without, with_post = step_norms(plain, store, 4, 8), step_norms(drift, store, 4, 8)
    print("EAGLE-3 hidden norm per chain step:", [f"{v:.1f}" for v in without["hidden"]])
    print("with the post-norm, hidden / passed:", [f"{v:.1f}" for v in with_post["hidden"]], with_post["passed"])
    assert without["passed"] == without["hidden"]  # the state handed on is the stream itself
    bound = float(drift.norm.weight.abs().max()) * drift.config.hidden_size**0.5
    assert all(p <= bound * (1 + 1e-5) for p in with_post["passed"])
    # Flat to within 5% over 8 steps (demo-full's chat drafter: 24.06 at every step, against 348 -> 449 without).
    assert max(with_post["passed"]) < 1.05 * min(with_post["passed"])
