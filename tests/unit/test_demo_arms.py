"""The demo's extra arms: each changes exactly one named thing against the arm it is compared with, a finished
run resumes with more arms, the harder sets' task prompts, and the report's paired comparisons."""

from pathlib import Path

import numpy as np
import pytest

from megatron_osprey.demo.commands import distill_argv
from megatron_osprey.demo.extra_arms import OFFLINE_ARMS, OTHER_NEURAL_ARMS
from megatron_osprey.demo.harder_sets import TASKS, task_rows
from megatron_osprey.demo.pipeline import prepare_demo_output
from megatron_osprey.demo.report_arms import COMPARISONS, comparisons, paired_gain, split_table
from megatron_osprey.demo.sizes import EXTRA_ARMS, DemoConfig


def _argv(tmp_path: Path, cfg: DemoConfig, method: str, init, extra=()):
    data = tmp_path / "chat.jsonl"
    data.write_text('{"id": "a"}\n' * 12)
    save = tmp_path / "drafters" / "x"
    return distill_argv(cfg, method, init, tmp_path / "t", "chat", data, tmp_path / "s", save, 0, 100, tuple(extra))


@pytest.mark.parametrize("arm", sorted(OFFLINE_ARMS))
def test_each_offline_arm_differs_from_its_base_by_its_named_change_only(tmp_path, arm):
    cfg = DemoConfig.quick()
    init_name, extra = OFFLINE_ARMS[arm]
    init = tmp_path / f"init_{init_name}" if init_name else None
    base_init = tmp_path / "init_osprey" if init_name else None  # Osprey's init, or EAGLE-3 from scratch
    arm_argv = [str(w) for w in _argv(tmp_path, cfg, arm, init, extra)]
    base_argv = [str(w) for w in _argv(tmp_path, cfg, "base", base_init)]
    # the base arm's command (same data, optimizer, tokens, seed), its init swapped, the arm's flags added
    swapped = [str(init) if init is not None and w == str(base_init) else w for w in base_argv]
    assert arm_argv == swapped[:-1] + list(extra) + ["--bf16"]
    assert "--drafter-init" in arm_argv if init_name else "--baseline" in arm_argv


def test_every_extra_arm_is_compared_or_tabled():
    compared = {a for a, b, _ in COMPARISONS} | {b for a, b, _ in COMPARISONS}
    assert set(EXTRA_ARMS) - compared == {"ngram", "ngram_monolingual"}  # their own table: no neural base


def test_with_arms_checks_names_and_keeps_one_order():
    cfg = DemoConfig.quick().with_arms(["ngram", "eagle3_2layer"])
    assert cfg.arms == ("eagle3_2layer", "ngram")
    assert cfg.with_arms(["osprey_opd"]).arms == ("eagle3_2layer", "osprey_opd", "ngram")
    assert DemoConfig.quick().with_arms(["all"]).arms == tuple(EXTRA_ARMS) == DemoConfig.full().arms
    with pytest.raises(ValueError, match="--arms bogus"):
        DemoConfig.quick().with_arms(["bogus"])


def test_a_finished_run_resumes_with_more_arms_but_not_with_another_size(tmp_path):
    output = tmp_path / "demo"
    prepare_demo_output(output, DemoConfig.quick())
    (output / "kept.txt").write_text("x")
    prepare_demo_output(output, DemoConfig.quick().with_arms(["all"]))  # more arms: the same run
    assert (output / "kept.txt").is_file()
    with pytest.raises(RuntimeError, match="another configuration"):
        prepare_demo_output(output, DemoConfig.smoke())


def test_task_rows_cover_every_language_and_task_with_rotating_sources():
    prompts = [(f"p{i}", f"text {i}") for i in range(3)]
    rows = task_rows(prompts, ("spanish", "french"), per_language=2)
    assert set(rows) == set(TASKS)
    for task, items in rows.items():
        assert len(items) == 4 and len({r["id"] for r in items}) == 4
        contents = [r["conversations"][0]["content"] for r in items]
        assert "Spanish" in contents[0] and "French" in contents[2]
        # sources taken in turn: spanish gets p0, p1; french p2, then p0 again
        assert [c.rsplit("\n", 1)[-1] for c in contents] == ["text 0", "text 1", "text 2", "text 0"]
    with pytest.raises(ValueError):
        task_rows([], ("spanish",), 1)


def test_paired_gain_is_the_ratio_of_cell_means_with_a_paired_interval():
    rng = np.random.default_rng(0)
    b = {0: {("chat", "chat"): {f"r{i}": float(v) for i, v in enumerate(rng.uniform(1, 2, 8))}}}
    a = {0: {k: {i: 1.25 * v for i, v in ids.items()} for k, ids in b[0].items()}}
    exact = paired_gain(a, b, rounds=200)
    assert exact["gain"] == pytest.approx(0.25) and exact["ci"] == pytest.approx([0.25, 0.25])  # paired
    assert (exact["cells"], exact["requests_per_cell"], exact["seeds"]) == (1, 8, 1)
    b[0][("chat", "code")] = {"x": 1.0, "y": 3.0}
    a[0][("chat", "code")] = {"x": 2.0, "y": 2.0, "z": 9.0}  # z has no partner: left out
    got = paired_gain(a, b, rounds=200)
    cell_a = [np.mean([1.25 * v for v in b[0][("chat", "chat")].values()]), 2.0]
    cell_b = [np.mean(list(b[0][("chat", "chat")].values())), 2.0]
    assert got["gain"] == pytest.approx(np.mean(cell_a) / np.mean(cell_b) - 1)
    assert got["ci"][0] <= got["gain"] <= got["ci"][1]
    assert paired_gain({0: {("a", "a"): {"x": 1.0}}}, {0: {("b", "b"): {"x": 1.0}}}) is None


def test_paired_gain_resamples_seeds_too():
    """Two seeds that disagree: the point estimate averages them, and the interval spans both seeds' gains,
    which resampling requests alone (one request per cell here) could not do."""
    b = {0: {("c", "c"): {"q": 1.0}}, 1: {("c", "c"): {"q": 1.0}}}
    a = {0: {("c", "c"): {"q": 1.0}}, 1: {("c", "c"): {"q": 2.0}}}
    got = paired_gain(a, b, rounds=400)
    assert got["gain"] == pytest.approx(0.5) and got["seeds"] == 2
    assert got["ci"] == pytest.approx([0.0, 1.0])


def _cell(method, drafter, train, split, als):
    requests = [{"id": f"q{i}", "acceptance_length": v} for i, v in enumerate(als)]
    return {"method": method, "drafter": drafter, "train_domain": train, "split": split, "requests": requests}


def test_comparisons_pair_each_arm_with_its_base_in_and_out_of_domain():
    main = {
        "cells": [
            _cell("eagle3", "e", "chat", "chat", [1.0, 1.2]),
            _cell("eagle3", "e", "chat", "code", [1.0, 1.0]),
            _cell("eagle3_2layer", "e2", "chat", "chat", [1.5, 1.8]),
            _cell("eagle3_2layer", "e2", "chat", "code", [1.1, 1.1]),
        ]
    }
    harder = {"cells": [_cell("eagle3", "e", "chat", "p", [1.0]), _cell("eagle3_2layer", "e2", "chat", "p", [2.0])]}
    (row,) = comparisons(main, harder, {"e": 0, "e2": 0})
    assert (row["arm"], row["base"]) == ("eagle3_2layer", "eagle3")
    assert row["id"]["gain"] == pytest.approx(3.3 / 2.2 - 1)
    assert row["ood"]["gain"] == pytest.approx(0.1)
    assert row["mean"]["gain"] == pytest.approx((1.65 + 1.1) / (1.1 + 1.0) - 1)
    assert row["harder"]["p"]["gain"] == pytest.approx(1.0)


def test_tables_leave_out_drafters_of_another_run():
    results = {
        "cells": [_cell("ngram", "ngram_chat", "chat", "chat", [1.5]), _cell("ngram", "old", "chat", "chat", [9])]
    }
    for cell in results["cells"]:
        cell["summary"] = {"draft_seconds_per_token": 1e-4}
    table = split_table(results, {"ngram_chat"})
    assert set(table) == {"ngram_chat"} and table["ngram_chat"]["draft_us"] == {"chat": pytest.approx(100.0)}


class RecordingSteps:
    """Records each step's command instead of running it."""

    def __init__(self):
        self.commands = {}

    def run(self, name, argv):
        assert name not in self.commands, name
        self.commands[name] = [str(w) for w in argv]

    def timed(self, name, seconds):
        pass


def _without_values(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    return [w for i, w in enumerate(argv) if not (i and argv[i - 1] in flags)]


def test_the_arms_steps_read_the_base_arms_data_store_and_seed(tmp_path):
    """extra_drafters' real commands: every offline arm reads the Osprey arm's regenerated data and store with
    its seed and tokens; Draft-OPD runs its online loop from the Osprey SFT drafter, and its equal-compute control
    trains Osprey SFT's updates plus exactly as many as Draft-OPD adds."""
    from transformers import LlamaConfig

    from megatron_osprey.demo.arms import distill_drafters
    from megatron_osprey.demo.extra_arms import extra_drafters

    target = tmp_path / "target"
    LlamaConfig(vocab_size=400).save_pretrained(target)
    cfg = DemoConfig.quick().with_arms(["all"])
    regenerated = {"chat": tmp_path / "chat.jsonl"}
    regenerated["chat"].write_text('{"id": "a"}\n' * 20)
    stores = {"chat": tmp_path / "store"}
    inits = {name: tmp_path / f"init_{name}" for name in ("osprey", "osprey_no_stage2", "osprey_monolingual")}
    inits["osprey_stage2_more"] = tmp_path / "init_more"
    data = {"splits": {"chat": {"train": tmp_path / "prompts.jsonl"}}, "monolingual": tmp_path / "mono.jsonl"}
    (tmp_path / "translated.jsonl").write_text('{"id": "t"}\n' * 20)
    data["translation"] = {"chat": (tmp_path / "translated.jsonl", tmp_path / "translation_store")}
    steps = RecordingSteps()
    distill_drafters(steps, cfg, tmp_path, target, inits, regenerated, stores)
    drafters = extra_drafters(steps, cfg, tmp_path, target, inits, regenerated, stores, data)
    base = steps.commands["distill_osprey_chat"]
    flags = ("--data-path", "--hidden-states", "--seed", "--train-iters", "--lr", "--global-batch-size", "--domain")
    for arm in OFFLINE_ARMS:
        argv = steps.commands[f"distill_{arm}_chat"]
        for flag in flags:
            assert argv[argv.index(flag) + 1] == base[base.index(flag) + 1], (arm, flag)
    assert not any(n.startswith("rollout_") for n in steps.commands)  # the online loop rolls out in its job
    opd = steps.commands["distill_osprey_opd_chat"]
    assert opd[opd.index("--drafter-init") + 1] == str(tmp_path / "drafters" / "osprey_chat")
    assert opd[opd.index("--mode") + 1] == "on-policy" and "--opd-form" not in opd  # the online form, the default
    assert opd[opd.index("--data-path") + 1] == str(data["splits"]["chat"]["train"])
    assert opd[opd.index("--opd-limit") + 1] == str(cfg.opd_prompts)
    assert opd[opd.index("--ttt-steps") + 1] == "7" and opd[opd.index("--lr-warmup-fraction") + 1] == "0.015"
    for flag in ("--seed", "--lr", "--global-batch-size"):
        assert opd[opd.index(flag) + 1] == base[base.index(flag) + 1], flag
    # equal compute: Draft-OPD's updates = opd_epochs x opd_prompts / batch, and the SFT control adds exactly those
    opd_iters, base_iters = int(opd[opd.index("--train-iters") + 1]), int(base[base.index("--train-iters") + 1])
    assert opd_iters == cfg.opd_epochs * cfg.opd_prompts // cfg.distill_batch == 64
    more = [str(w) for w in steps.commands["distill_osprey_sft_more_chat"]]
    assert int(more[more.index("--train-iters") + 1]) == base_iters + opd_iters
    # otherwise the base arm's command: its init, data, store, lr, seed (its length, save and log cadence aside)
    base_str = [str(w) for w in base]
    assert _without_values(more, ("--train-iters", "--save", "--save-interval", "--log-interval")) == _without_values(
        base_str, ("--train-iters", "--save", "--save-interval", "--log-interval")
    )
    translation = [str(w) for w in steps.commands["distill_osprey_translation_chat"]]
    assert translation[translation.index("--hidden-states") + 1] == str(tmp_path / "translation_store")
    assert translation[translation.index("--data-path") + 1] == str(tmp_path / "translated.jsonl")
    for flag in ("--drafter-init", "--train-iters", "--lr", "--seed"):  # 20 conversations each: the same updates
        assert translation[translation.index(flag) + 1] == base_str[base_str.index(flag) + 1], flag
    assert {d["name"] for d in drafters if d.get("ngram")} == {"ngram_chat", "ngram_monolingual_multilingual"}
    ngram = steps.commands["ngram_monolingual_multilingual"]
    assert ngram[ngram.index("--input") + 1] == str(data["monolingual"])


def test_at_full_size_the_extra_arms_train_and_evaluate_seed_0_only(tmp_path):
    from transformers import LlamaConfig

    from megatron_osprey.demo.arms import evaluate_drafters
    from megatron_osprey.demo.extra_arms import extra_drafters

    target = tmp_path / "target"
    LlamaConfig(vocab_size=400).save_pretrained(target)
    cfg = DemoConfig.full()
    regenerated = {d: tmp_path / f"{d}.jsonl" for d in cfg.train_domains}
    for path in regenerated.values():
        path.write_text('{"id": "a"}\n' * 20)
    inits = {n: tmp_path / n for n in ("osprey", "osprey_no_stage2", "osprey_monolingual", "osprey_stage2_more")}
    splits = {d: {"train": tmp_path / f"p_{d}.jsonl", "eval": tmp_path / f"e_{d}.jsonl"} for d in cfg.domains()}
    data = {"splits": splits, "monolingual": tmp_path / "mono.jsonl"}
    data["translation"] = {d: (regenerated[d], tmp_path) for d in cfg.train_domains}
    steps = RecordingSteps()
    stores = {d: tmp_path for d in regenerated}
    drafters = extra_drafters(steps, cfg, tmp_path, target, inits, regenerated, stores, data)
    neural = [d for d in drafters if not d.get("ngram")]
    assert {d["seed"] for d in neural} == {0} and len(neural) == 2 * (len(OFFLINE_ARMS) + len(OTHER_NEURAL_ARMS))
    with pytest.raises(FileNotFoundError, match="seed0"):  # no step ran: the merge finds no results to read
        evaluate_drafters(steps, cfg, target, tmp_path / "arms", neural, data, name="eval_arms")
    assert {n for n in steps.commands if n.startswith("eval_arms")} == {"eval_arms_s0"}  # seeds 1, 2: nothing


def test_the_offline_benchmark_suite_is_written_by_osprey_suite_and_evaluated_on_seed_0s_drafters(tmp_path):
    """HumanEval (the suite a pinned package ships): `osprey suite`'s stage writes the demo's first n_eval
    prompts, and one eval step runs seed 0's base and extra drafters on it, after the harder sets."""
    from megatron_osprey.demo.extra_arms import evaluate_extra
    from megatron_osprey.demo.harder_sets import OFFLINE_SUITES, build_suite_sets

    cfg = DemoConfig.full()
    steps = RecordingSteps()
    suites = build_suite_sets(steps, cfg, tmp_path)
    assert OFFLINE_SUITES == ("humaneval",) and suites == [tmp_path / "data" / "suites" / "humaneval.jsonl"]
    written = steps.commands["suite_humaneval"]
    assert written[:3] == ["-m", "megatron_osprey", "suite"] and written[written.index("--limit") + 1] == "32"
    assert written[written.index("--source") + 1] == "package"
    base = [{"name": f"{m}_chat_s{s}", "method": m, "domain": "chat", "seed": s, "path": tmp_path} for m in
            ("osprey", "eagle3") for s in (0, 1)]  # fmt: skip
    data = {"splits": {d: {"eval": tmp_path / f"e_{d}.jsonl"} for d in cfg.domains()}}
    evaluate_extra(steps, cfg, tmp_path, tmp_path / "eval", base, [], data, [tmp_path / "h.jsonl"], suites)
    command = steps.commands["eval_suites"]
    assert command[command.index("--data") + 1] == str(suites[0]) and command.count("--data") == 1
    named = [command[i + 1] for i, w in enumerate(command) if w == "--drafter"]
    assert [n.split("=")[0] for n in named] == ["osprey_chat_s0", "eagle3_chat_s0"]
    assert list(steps.commands).index("eval_suites") == list(steps.commands).index("eval_harder") + 1


def test_the_ttt_depth_arms_are_evaluated_in_a_group_of_their_own(tmp_path, monkeypatch):
    """Adding a group of arms to a finished run leaves the other groups' eval steps (and the harder sets') as
    they were; every group is merged with the base arms' results."""
    from megatron_osprey.demo import arms as base_arms
    from megatron_osprey.demo import extra_arms

    groups, merged = {}, []
    monkeypatch.setattr(base_arms, "evaluate_drafters", lambda s, c, t, d, drafters, data, name: groups.update(
        {name: (d.name, sorted(x["method"] for x in drafters))}))  # fmt: skip
    monkeypatch.setattr(extra_arms, "combine_evaluations", lambda cfg, dirs, out: merged.append(dirs) or out)
    cfg = DemoConfig.quick()
    made = [{"name": f"{m}_chat", "method": m, "domain": "chat", "seed": 0, "path": tmp_path} for m in OFFLINE_ARMS]
    steps = RecordingSteps()
    data = {"splits": {d: {"eval": tmp_path / f"e_{d}.jsonl"} for d in cfg.domains()}}
    out = extra_arms.evaluate_extra(steps, cfg, tmp_path, tmp_path / "eval", [], made, data, [tmp_path / "h"], [])
    ttt = ["eagle3_drift_ttt3", "eagle3_ttt3"]
    assert groups == {
        "eval_arms": ("arms", sorted(set(OFFLINE_ARMS) - set(ttt))),
        "eval_arms_ttt_depth": ("arms_ttt_depth", ttt),
    }
    assert merged == [[tmp_path / "eval", tmp_path / "eval" / "arms", tmp_path / "eval" / "arms_ttt_depth"]]
    assert out == tmp_path / "eval" / "combined"
    harder = steps.commands["eval_harder"]
    assert not any(w.startswith(("eagle3_ttt3", "eagle3_drift_ttt3")) for w in harder)
    for arm in ttt:  # trained with 3 TTT steps; every eval drafts chains of 5
        assert OFFLINE_ARMS[arm][1][-2:] == ("--ttt-steps", "3") and arm in EXTRA_ARMS


def test_translation_rows_rotate_the_task_languages_over_the_training_prompts(tmp_path):
    """The translation fine-tuning arm asks for one translation per training prompt, the languages in turn, with the
    harder sets' translation template; the full demo evaluates all 11 task languages, the monolingual five first."""
    from megatron_osprey.demo.harder_sets import TASK_LANGUAGES, translation_rows, write_task_sets
    from megatron_osprey.recipes.cpu import MONOLINGUAL_LANGUAGES

    rows = translation_rows([("a", "Hello there."), ("b", "Good bye."), ("c", "Thanks.")], ("spanish", "korean"))
    assert [r["id"] for r in rows] == ["translation-spanish-a", "translation-korean-b", "translation-spanish-c"]
    expected = TASKS["translation"].format(language="Korean", text="Good bye.")
    assert rows[1]["conversations"] == [{"role": "user", "content": expected}]
    assert len(set(TASK_LANGUAGES)) == 11 and TASK_LANGUAGES[:5] == MONOLINGUAL_LANGUAGES
    assert DemoConfig.full().task_languages == len(TASK_LANGUAGES) and DemoConfig.quick().task_languages == 5
    eval_path = tmp_path / "eval.jsonl"
    eval_path.write_text('{"id": "e1", "conversations": [{"role": "user", "content": "Hi."}]}\n')
    translation, story = write_task_sets(DemoConfig.full(), eval_path, tmp_path / "harder")
    languages = {line.split('"id": "')[1].split("-")[1] for line in translation.read_text().splitlines()}
    assert languages == set(TASK_LANGUAGES) and story.is_file()
