"""AL evaluation: CLI losslessness, AL extremes at the eval level, aggregation and the train x eval matrix."""

import json

import pytest
import torch

from megatron_osprey.eval import benchmark
from megatron_osprey.eval.matrix import Cell, build_matrices, summarize
from megatron_osprey.eval.prompts import load_prompts, turn_id
from megatron_osprey.eval.run import write_results
from megatron_osprey.models.drafter.reference import DrafterConfig, ReferenceDrafter
from megatron_osprey.stages.evaluate import main
from tests.unit.test_speculative import OracleSession


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """A 4-layer Llama target with a small Llama-3-style chat tokenizer, a random drafter, two splits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_osprey.data.regenerate.tiny_target import build_tiny_tokenizer

    root = tmp_path_factory.mktemp("eval")
    tok = build_tiny_tokenizer("llama3")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.convert_tokens_to_ids("<|eot_id|>"),
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked outputs: greedy text is not one repeated token
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    torch.manual_seed(1)
    drafter = ReferenceDrafter(
        DrafterConfig(
            hidden_size=32,
            target_hidden_size=32,
            num_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=32,
            vocab_size=len(tok),
            aux_layer_ids=[0, 1, 2],
        )
    )
    drafter.save_pretrained(root / "drafter")
    for split in ("code", "math"):
        rows = [
            {
                "id": f"{split}-{i}",
                "conversations": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": f"{split} question {i}: what is two plus {i}?"},
                    {"role": "assistant", "content": "four"},
                    {"role": "user", "content": "never part of the prompt"},
                ],
            }
            for i in range(2)
        ]
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _cli(root, out, *extra):
    return main(
        [
            "--target",
            str(root / "target"),
            "--drafter",
            f"a={root / 'drafter'}",
            "--drafter",
            f"b={root / 'drafter'}",
            "--train-domain",
            "code",
            "math",
            "--data",
            str(root / "code.jsonl"),
            "--data",
            str(root / "math.jsonl"),
            "--output",
            str(out),
            "--steps",
            "2",
            "--max-new-tokens",
            "7",
            "--no-progress",
            *extra,
        ]
    )


def test_prompts_stop_at_the_first_assistant_turn_in_file_order(tiny_setup):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_setup / "target"))
    prompts = load_prompts(tiny_setup / "math.jsonl", tok)
    assert [p.id for p in prompts] == ["math-0", "math-1"]
    text = tok.decode(prompts[1].input_ids)
    assert text.startswith("<|begin_of_text|>") and text.count("<|begin_of_text|>") == 1
    assert "two plus 1?" in text and "never part" not in text and "four" not in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert [p.id for p in load_prompts(tiny_setup / "math.jsonl", tok, limit=1)] == ["math-0"]
    # The paper's benchmark sends the first user message alone; before_assistant keeps the system prompt.
    assert "be brief" not in text
    earlier = tok.decode(load_prompts(tiny_setup / "math.jsonl", tok, mode="before_assistant")[1].input_ids)
    assert "be brief" in earlier and "two plus 1?" in earlier and "never part" not in earlier


def test_eval_defaults_are_the_papers_protocol():
    from megatron_osprey.stages import evaluate
    from megatron_osprey.stages.cli import parse_config

    argv = ["--target", "T", "--drafter", "D", "--data", "x.jsonl", "--output", "O"]
    config, _ = parse_config(argv, "evaluate", evaluate.EvaluateConfig, evaluate.FLAGS, evaluate.__doc__)
    config = config.resolved()
    # --temperature takes a sweep: the default is the one temperature 0.0.
    assert (config.max_new_tokens, config.prompt_messages, config.temperature, config.steps, config.topk) == (
        4096,
        "first_user",
        [0.0],
        5,
        1,
    )


def test_cli_sweeps_temperature_and_draft_tokens_one_row_per_combination(tiny_setup, tmp_path):
    assert _cli(tiny_setup, tmp_path, "--temperature", "0", "1", "--draft-tokens", "2", "3", "--seed", "7") == 0
    results = json.loads((tmp_path / "results.json").read_text())
    rows = [(r["temperature"], r["draft_tokens"], r["steps"], r["seed"], r["sampling"]) for r in results["sweep"]]
    assert rows == [
        (0.0, 2, 1, 7, "greedy"),
        (0.0, 3, 2, 7, "greedy"),
        (1.0, 2, 1, 7, "lossless rejection sampling"),
        (1.0, 3, 2, 7, "lossless rejection sampling"),
    ]
    assert len(results["cells"]) == 2 * 2 * 4  # drafters x splits x combinations
    assert results["matrices"] == results["sweep"][0]["matrices"]
    for row in results["sweep"]:
        cells = [
            c
            for c in results["cells"]
            if (c["temperature"], c["draft_tokens"]) == (row["temperature"], row["draft_tokens"])
        ]
        assert len(cells) == 4
        for cell in cells:  # a chain of d draft tokens emits at most d tokens per verify
            assert all(1 <= n <= row["draft_tokens"] for r in cell["requests"] for n in r["accept_lengths"])
    table = (tmp_path / "matrix.md").read_text().split("## Sweep")[1]
    assert table.count("| eagle3 |") + table.count("| osprey |") == 4  # one row per combination and method
    assert "| 1 | 3 | 2 | 1 | 7 | lossless rejection sampling |" in table


def test_cli_greedy_output_is_lossless_and_results_cover_every_prompt(tiny_setup, tmp_path, capsys):
    assert _cli(tiny_setup, tmp_path, "--verify-lossless") == 0
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval: ")]
    assert [line.split(":")[1].strip() for line in progress] == ["a on code", "a on math", "b on code", "b on math"]
    assert progress[-1].endswith("(8/8 requests done)")
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["lossless"] == {"checked": True, "mismatches": []}
    assert [(c["drafter"], c["split"]) for c in results["cells"]] == [
        ("a", "code"),
        ("a", "math"),
        ("b", "code"),
        ("b", "math"),
    ]
    for cell in results["cells"]:
        assert [r["id"] for r in cell["requests"]] == [f"{cell['split']}-0", f"{cell['split']}-1"]
        for r in cell["requests"]:
            assert r["acceptance_length"] == r["completion_tokens"] / r["verify_count"]
            assert r["completion_tokens"] == 1 + sum(r["accept_lengths"]) and r["mismatch_at"] is None
    matrix = results["matrices"]["osprey"]
    assert matrix["train_domains"] == ["code", "math"] and matrix["id_cells"] == 2 and matrix["ood_cells"] == 2
    assert (tmp_path / "matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| code (a) |" in (tmp_path / "matrix.md").read_text()


def test_batch_size_gives_the_same_requests_as_the_reference_engine(tiny_setup, tmp_path):
    """--batch-size 3 (rows of different prompt lengths, one group short) decodes every request to the same
    tokens and acceptance as batch 1, and checks them against batched target-only decoding."""
    outputs = {}
    for batch in (1, 3):
        assert _cli(tiny_setup, tmp_path / str(batch), "--verify-lossless", "--batch-size", str(batch)) == 0
        results = json.loads((tmp_path / str(batch) / "results.json").read_text())
        assert results["config"]["batch_size"] == batch and results["lossless"]["mismatches"] == []
        outputs[batch] = [
            (c["drafter"], c["split"], r["id"], r["output_ids"], r["accept_lengths"])
            for c in results["cells"]
            for r in c["requests"]
        ]
    assert outputs[1] == outputs[3] and len(outputs[1]) == 8
    # --replay: the same requests from the target's greedy output, with no verify forwards.
    assert _cli(tiny_setup, tmp_path / "replay", "--replay", "--batch-size", "3") == 0
    results = json.loads((tmp_path / "replay" / "results.json").read_text())
    assert results["config"]["replay"] and not results["lossless"]["checked"]
    assert [
        (c["drafter"], c["split"], r["id"], r["output_ids"], r["accept_lengths"])
        for c in results["cells"]
        for r in c["requests"]
    ] == outputs[1]


def test_batch_size_and_replay_refuse_what_they_cannot_decode(tiny_setup, tmp_path, capsys):
    for extra in (
        ["--topk", "2", "--draft-tokens", "4"],
        ["--temperature", "0.5"],
        ["--target-backend", "megatron"],
        [],
    ):
        batch = "0" if not extra else "4"
        assert _cli(tiny_setup, tmp_path, "--batch-size", batch, *extra) == 2
        assert "--batch-size" in capsys.readouterr().err
    for extra in (["--verify-lossless"], ["--topk", "2", "--draft-tokens", "4"], ["--target-backend", "megatron"]):
        assert _cli(tiny_setup, tmp_path, "--replay", *extra) == 2
        assert "--replay" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_merged_evaluations_equal_one_evaluation_of_all_drafters(tiny_setup, tmp_path):
    """The demo evaluates each seed's drafters in its own resumable step and merges the results."""
    from megatron_osprey.eval.run import merge_results

    common = [
        "--data",
        str(tiny_setup / "code.jsonl"),
        "--data",
        str(tiny_setup / "math.jsonl"),
        "--steps",
        "2",
        "--max-new-tokens",
        "7",
        "--no-progress",
        "--verify-lossless",
        "--target",
        str(tiny_setup / "target"),
    ]
    parts = []
    for name, domain in (("a", "code"), ("b", "math")):
        out = tmp_path / name
        assert (
            main(
                [
                    *common,
                    "--drafter",
                    f"{name}={tiny_setup / 'drafter'}",
                    "--train-domain",
                    domain,
                    "--output",
                    str(out),
                ]
            )
            == 0
        )
        parts.append(json.loads((out / "results.json").read_text()))
    merged = merge_results(parts, tmp_path / "merged")
    assert _cli(tiny_setup, tmp_path / "both", "--verify-lossless") == 0
    both = json.loads((tmp_path / "both" / "results.json").read_text())
    strip = lambda cells: [(c["drafter"], c["split"], [r["output_ids"] for r in c["requests"]]) for c in cells]  # noqa: E731
    assert strip(merged["cells"]) == strip(both["cells"])
    for key in ("mean", "id_mean", "ood_mean", "acceptance_length", "train_domains"):
        assert merged["matrices"]["osprey"][key] == both["matrices"]["osprey"][key], key
    assert json.loads((tmp_path / "merged" / "results.json").read_text())["lossless"] == {
        "checked": True,
        "mismatches": [],
    }
    with pytest.raises(ValueError, match="drafter names repeat"):
        merge_results([parts[0], parts[0]], tmp_path / "again")


def test_cli_reports_a_broken_verifier_and_exits_nonzero(tiny_setup, tmp_path, monkeypatch, capsys):
    def accept_every_draft(tree, target_logits):  # ignores the target: not lossless
        path, node = [], -1
        while tree.children(node):
            node = tree.children(node)[0]
            path.append(node)
        return path, int(torch.argmax(target_logits[len(path)]))

    monkeypatch.setattr("megatron_osprey.speculative.generate.accept_greedy", accept_every_draft)
    assert _cli(tiny_setup, tmp_path, "--verify-lossless") == 1
    assert "LOSSLESS MISMATCH" in capsys.readouterr().err
    mismatches = json.loads((tmp_path / "results.json").read_text())["lossless"]["mismatches"]
    assert len(mismatches) == 8 and all(m["index"] >= 1 for m in mismatches)  # token 0 comes from prefill


@pytest.mark.parametrize("mode", ["exact", "wrong"])
def test_identical_drafter_gives_al_draft_tokens_and_wrong_drafter_al_one(tiny_setup, tmp_path, monkeypatch, mode):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_setup / "target")).eval()
    monkeypatch.setattr(benchmark, "make_session", lambda drafter, *vocab: OracleSession(model, mode))
    assert _cli(tiny_setup, tmp_path, "--max-new-tokens", "10", "--verify-lossless") == 0
    results = json.loads((tmp_path / "results.json").read_text())
    for cell in results["cells"]:
        for r in cell["requests"]:
            if mode == "exact":  # every verify but the last gains all 3 tokens (steps 2 -> draft tokens 3)
                assert r["accept_lengths"][:-1] == [3] * (r["verify_count"] - 1)
            else:
                assert r["accept_lengths"] == [1] * r["verify_count"]
                assert r["acceptance_length"] == r["completion_tokens"] / (r["completion_tokens"] - 1)
    if mode == "exact":
        al = results["matrices"]["osprey"]["mean"]
        assert al > 2.5  # 10 tokens in 3 verifies (3 + 3 + 3 after the prefill token) unless EOS cut it short


def test_bad_flags_name_the_flag(tiny_setup, tmp_path, capsys):
    assert _cli(tiny_setup, tmp_path, "--temperature", "0.7", "--verify-lossless") == 2
    assert "--verify-lossless" in capsys.readouterr().err
    assert (
        main(
            [
                "--target",
                str(tmp_path / "nope"),
                "--drafter",
                str(tiny_setup / "drafter"),
                "--data",
                str(tiny_setup / "code.jsonl"),
                "--output",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    assert "--target" in capsys.readouterr().err


def _requests(pairs, seconds=1.0):
    return [{"completion_tokens": t, "verify_count": v, "seconds": seconds} for t, v in pairs]


def test_aggregation_per_request_mean_differs_from_pooled_and_both_are_right(tmp_path):
    # A short request with high AL and a long one with low AL: the two definitions disagree.
    summary = summarize(_requests([(8, 2), (30, 20)], seconds=2.0))
    assert summary["mean_acceptance_length"] == pytest.approx((4.0 + 1.5) / 2)  # 2.75
    assert summary["pooled_acceptance_length"] == pytest.approx(38 / 22)  # 1.727...
    assert summary["tokens_per_s"] == pytest.approx(38 / 4.0)

    cells = [
        Cell("osp-code", "osprey", "code", "code", summarize(_requests([(8, 2), (30, 20)]))),  # 2.75
        Cell("osp-code", "osprey", "code", "math", summarize(_requests([(10, 5)]))),  # 2.0
        Cell("osp-math", "osprey", "math", "code", summarize(_requests([(9, 6), (3, 3)]))),  # 1.25
        Cell("osp-math", "osprey", "math", "math", summarize(_requests([(12, 3)]))),  # 4.0
        Cell("e3-code", "eagle3", "code", "code", summarize(_requests([(6, 3)]))),  # 2.0
        Cell("e3-code", "eagle3", "code", "math", summarize(_requests([(6, 6)]))),  # 1.0
    ]
    matrices = build_matrices(cells, ["code", "math"])
    osprey = matrices["osprey"]
    assert osprey["acceptance_length"] == [[2.75, 2.0], [1.25, 4.0]]
    assert osprey["pooled_acceptance_length"][1][0] == pytest.approx(12 / 9)
    assert osprey["id_mean"] == pytest.approx((2.75 + 4.0) / 2)
    assert osprey["ood_mean"] == pytest.approx((2.0 + 1.25) / 2)
    assert osprey["mean"] == pytest.approx((2.75 + 2.0 + 1.25 + 4.0) / 4)
    assert (matrices["eagle3"]["id_mean"], matrices["eagle3"]["ood_mean"], matrices["eagle3"]["mean"]) == (
        2.0,
        1.0,
        1.5,
    )

    results = {
        "config": {"target": "T", "steps": 5, "topk": 1, "draft_tokens": 6, "temperature": 0.0, "max_new_tokens": 8},
        "splits": [{"name": "code", "requests": 2}, {"name": "math", "requests": 1}],
        "matrices": matrices,
        "cells": [],
        "lossless": {"checked": False, "mismatches": []},
    }
    write_results(results, tmp_path)
    text = (tmp_path / "matrix.md").read_text()
    assert "| osprey | 2.500 | 3.375 | 1.625 | 2/2 |" in text
    assert "| eagle3 | 1.500 | 2.000 | 1.000 | 1/1 |" in text
    assert "| code (osp-code) | **2.750 (1.727)** | 2.000 (2.000) |" in text
    assert "| math (osp-math) | 1.250 (1.333) | **4.000 (4.000)** |" in text
    assert json.loads((tmp_path / "results.json").read_text())["matrices"]["osprey"]["mean"] == 2.5
    assert (tmp_path / "matrix.png").stat().st_size > 1000


def test_a_conversations_turns_are_pooled_into_one_al_as_the_release_counts_mt_bench():
    # Conversation a: turn 1 8 tokens / 2 verifies, turn 2 30 / 20 -> pooled 38 / 22; b: one turn, 9 / 3.
    requests = [
        {"id": "a", "completion_tokens": 8, "verify_count": 2, "seconds": 1.0},
        {"id": "b", "completion_tokens": 9, "verify_count": 3, "seconds": 1.0},
        {"id": turn_id("a", 2), "completion_tokens": 30, "verify_count": 20, "seconds": 1.0},
    ]
    summary = summarize(requests)
    assert (summary["requests"], summary["conversations"]) == (3, 2)
    assert summary["mean_acceptance_length"] == pytest.approx((38 / 22 + 3.0) / 2)
    assert summary["turn_mean_acceptance_length"] == pytest.approx((4.0 + 3.0 + 1.5) / 3)
    assert summary["pooled_acceptance_length"] == pytest.approx(47 / 25)
    # One turn per conversation: the two means are the same figure.
    single = summarize(requests[:2])
    assert single["mean_acceptance_length"] == single["turn_mean_acceptance_length"] == pytest.approx(3.5)


def _short_target(root, tmp_path, max_positions):
    """A copy of the tiny target whose config allows only `max_positions` positions."""
    import shutil

    short = tmp_path / "short_target"
    shutil.copytree(root / "target", short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps(config | {"max_position_embeddings": max_positions}))
    return short


def test_a_prompt_longer_than_the_target_allows_is_refused_or_truncated_on_request(tiny_setup, tmp_path, capsys):
    long_split = tmp_path / "long.jsonl"
    long_split.write_text(
        json.dumps({"id": "long-0", "conversations": [{"role": "user", "content": "count: " + "one two three " * 40}]})
        + "\n"
        + (tiny_setup / "code.jsonl").read_text()
    )
    target = _short_target(tiny_setup, tmp_path, 96)
    argv = [
        "--target",
        str(target),
        "--drafter",
        f"a={tiny_setup / 'drafter'}",
        "--data",
        str(long_split),
        "--steps",
        "2",
        "--max-new-tokens",
        "7",
        "--no-progress",
    ]
    assert main(argv + ["--output", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert "prompt 'long-0' has" in err and "max_position_embeddings 96" in err and "--truncate-prompts" in err
    assert not (tmp_path / "refused" / "results.json").exists()
    assert main(argv + ["--output", str(tmp_path / "cut"), "--truncate-prompts"]) == 0
    results = json.loads((tmp_path / "cut" / "results.json").read_text())
    assert results["splits"][0]["truncated_prompts"] == 1 and results["splits"][0]["requests"] == 3


def test_a_drafter_for_another_target_hidden_size_is_refused_naming_both(tiny_setup, tmp_path, capsys):
    other = ReferenceDrafter(
        DrafterConfig(
            hidden_size=32,
            target_hidden_size=48,
            num_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=32,
            vocab_size=ReferenceDrafter.from_pretrained(tiny_setup / "drafter").config.vocab_size,
            aux_layer_ids=[0, 1, 2],
        )
    )
    other.save_pretrained(tmp_path / "other_drafter")
    assert (
        main(
            [
                "--target",
                str(tiny_setup / "target"),
                "--drafter",
                str(tmp_path / "other_drafter"),
                "--data",
                str(tiny_setup / "code.jsonl"),
                "--output",
                str(tmp_path / "o"),
                "--no-progress",
                "--max-new-tokens",
                "16",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        f"--drafter {tmp_path / 'other_drafter'} was trained on hidden states of size 48, but --target "
        f"{tiny_setup / 'target'} has hidden_size 32"
    ) in err


def test_an_existing_results_json_needs_overwrite(tiny_setup, tmp_path, capsys):
    assert _cli(tiny_setup, tmp_path) == 0
    first = (tmp_path / "results.json").read_bytes()
    assert _cli(tiny_setup, tmp_path) == 2
    assert "results.json already exists; pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "results.json").read_bytes() == first
    assert _cli(tiny_setup, tmp_path, "--overwrite") == 0


def test_help_says_a_megatron_checkpoint_must_be_trusted(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "evaluate only checkpoints you trust" in " ".join(capsys.readouterr().out.split())


def test_an_output_that_cannot_be_written_is_refused_before_the_run(tiny_setup, tmp_path, monkeypatch, capsys):
    import megatron_osprey.eval.run as eval_run

    def run_eval(config):
        raise ValueError("the run started")

    monkeypatch.setattr(eval_run, "run_eval", run_eval)
    (tmp_path / "file.txt").write_text("not a directory")
    # Below a regular file no directory can be created, whoever runs the test (root ignores permission bits).
    assert _cli(tiny_setup, tmp_path / "file.txt" / "out") == 2
    err = capsys.readouterr().err
    assert f"--output {tmp_path / 'file.txt' / 'out'} cannot be written" in err and len(err.splitlines()) == 1
    assert "the run started" not in err
    # A writable --output reaches the run, and the probe leaves nothing behind.
    assert _cli(tiny_setup, tmp_path / "fresh") == 2 and "the run started" in capsys.readouterr().err
    assert list((tmp_path / "fresh").iterdir()) == []


def test_mt_bench_sends_its_system_prompt_and_second_turn_after_the_first_answer(tiny_setup, tmp_path):
    """The release's MT-Bench (benchmarks/benchmarker/mtbench.py): system prompt, question 1, the model's answer,
    question 2; both turns are requests. Checked against transformers' own greedy decode and chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_osprey.eval.suites import MT_BENCH_SYSTEM_PROMPT, write_suite

    source = tmp_path / "question.jsonl"
    turns = [[f"Write about {i} cats.", f"Now about {i} dogs."] for i in range(2)]
    source.write_text("".join(json.dumps({"question_id": 81 + i, "turns": t}) + "\n" for i, t in enumerate(turns)))
    data = tmp_path / "mtbench.jsonl"
    assert write_suite("mtbench", source, data) == 2
    cells = []
    for engine in (["--verify-lossless"], ["--verify-lossless", "--batch-size", "2"], ["--replay"]):
        out = tmp_path / str(len(cells))
        argv = ["--target", str(tiny_setup / "target"), "--drafter", f"a={tiny_setup / 'drafter'}", "--data", str(data)]
        argv += ["--output", str(out), "--steps", "2", "--max-new-tokens", "7", "--no-progress", *engine]
        assert main(argv) == 0
        cells += json.loads((out / "results.json").read_text())["cells"]
    requests = cells[0]["requests"]
    assert [r["id"] for r in requests] == ["mtbench/81", "mtbench/82", "mtbench/81#turn2", "mtbench/82#turn2"]
    for other in cells[1:]:  # the batched and the replay engines send the same turns and get the same answers
        assert [(r["id"], r["output_ids"]) for r in other["requests"]] == [(r["id"], r["output_ids"]) for r in requests]
    tok = AutoTokenizer.from_pretrained(tiny_setup / "target")
    model = AutoModelForCausalLM.from_pretrained(tiny_setup / "target")
    system = {"role": "system", "content": MT_BENCH_SYSTEM_PROMPT}
    for i, (first, second) in enumerate(turns):
        messages = [system, {"role": "user", "content": first}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        greedy = model.generate(**ids, max_new_tokens=7, do_sample=False)[0, ids["input_ids"].shape[1] :].tolist()
        assert requests[i]["prompt_tokens"] == ids["input_ids"].shape[1]
        assert requests[i]["output_ids"] == greedy[: len(requests[i]["output_ids"])]
        answer = tok.decode(requests[i]["output_ids"], skip_special_tokens=True)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": second}]
        expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert requests[2 + i]["prompt_tokens"] == len(expected["input_ids"])


def test_truncation_keeps_a_prompts_messages_and_refuses_to_cut_a_two_turn_conversation(tmp_path):
    """--truncate-prompts left-cuts a first turn's ids and keeps its messages; a row with later turns (MT-Bench) is
    refused naming --first-turn-only, rather than losing its second turn in silence."""
    from types import SimpleNamespace

    from megatron_osprey.eval.checks import fit_prompts
    from megatron_osprey.eval.prompts import EvalPrompt

    messages = ({"role": "user", "content": "q1"},)
    single = EvalPrompt("a", torch.arange(20), messages=messages)
    config = SimpleNamespace(max_new_tokens=4, truncate_prompts=True)
    (cut,), count = fit_prompts([single], tmp_path / "d.jsonl", config, 16, 2)
    assert count == 1 and cut.input_ids.tolist() == list(range(10, 20)) and cut.messages == messages
    two_turns = EvalPrompt("mtbench/81", torch.arange(20), messages=messages, next_turns=("q2",))
    with pytest.raises(ValueError, match="'mtbench/81' has 20 tokens and later turns.*--first-turn-only"):
        fit_prompts([two_turns], tmp_path / "d.jsonl", config, 16, 2)
    assert fit_prompts([two_turns], tmp_path / "d.jsonl", config, 64, 2) == ([two_turns], 0)
