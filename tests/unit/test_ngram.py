"""N-gram drafter: counts, back-off, the store, corpora through the chat template, and lossless evaluation."""

import json

import numpy as np
import pytest
import torch

from megatron_osprey.speculative import SpecConfig, build_chain
from megatron_osprey.speculative import ngram as ngram_module
from megatron_osprey.speculative.ngram import (
    NGRAM_FORMAT_TAG,
    NgramCounter,
    NgramDrafter,
    NgramDraftSession,
    count_ngrams,
    is_ngram_dir,
)

# Hand-made corpus over ids 0..9. Bigram counts after 1: 2 x3, 5 x1; after (7, 1): 5 x1; after (1, 2): 3 x2, 4 x1.
CORPUS = [[1, 2, 3, 1, 2, 4], [7, 1, 5], [1, 2, 3]]


def test_counts_keep_the_most_frequent_continuation_with_its_counts():
    drafter = count_ngrams(CORPUS, order=3, vocab_size=10)
    assert drafter.lookup([1]) == (2, 3, 4)  # 1 -> 2 three times of four
    assert drafter.lookup([1, 2]) == (3, 2, 3)
    assert drafter.lookup([2, 4]) is None  # 4 ends its sequence: nothing follows it
    assert drafter.lookup([7, 1]) == (5, 1, 1)
    assert drafter.lookup([3]) == (1, 1, 1)  # contexts never cross sequences: 3 ends the third one
    # Distinct contexts: length 1: 1, 2, 3, 7; length 2: (1,2), (2,3), (3,1), (7,1).
    assert [t.keys.size for t in drafter.tables] == [4, 4]
    # A tie goes to the smaller id; --min-count drops contexts whose winner is rarer.
    assert count_ngrams([[4, 9], [4, 8]], order=2, vocab_size=10).lookup([4]) == (8, 1, 2)
    pruned = count_ngrams(CORPUS, order=3, vocab_size=10, min_count=2)
    assert pruned.lookup([1]) == (2, 3, 4) and pruned.lookup([7, 1]) is None and pruned.lookup([3]) is None


def test_targets_mask_which_tokens_are_counted_but_contexts_see_everything():
    ids, targets = np.array([5, 6, 7, 8]), np.array([False, False, True, True])
    drafter = count_ngrams([(ids, targets)], order=3, vocab_size=10)
    assert drafter.lookup([5]) is None  # 6 is not a target
    assert drafter.lookup([5, 6]) == (7, 1, 1)  # 7 is, and its context reaches back into the non-targets
    assert drafter.lookup([6, 7]) == (8, 1, 1)


def test_back_off_from_an_unseen_long_context_to_shorter_ones_and_to_nothing():
    drafter = count_ngrams([[1, 2, 3, 4], [9, 3, 5], [8, 3, 5]], order=4, vocab_size=10)
    assert drafter.predict([1, 2, 3]) == 4  # the full 3-token context
    assert drafter.predict([0, 2, 3]) == 4  # (0,2,3) unseen -> (2,3)
    assert drafter.predict([0, 0, 3]) == 5  # (0,0,3), (0,3) unseen -> (3): 5 twice, 4 once
    assert drafter.predict([0, 0, 0]) is None  # nothing known
    assert drafter.predict([]) is None
    assert drafter.draft([1, 2], 5) == [3, 4]  # stops where no context is known (4 is never followed)


def test_session_proposes_a_chain_that_stops_where_the_table_has_nothing():
    drafter = count_ngrams([[1, 2, 3, 4]], order=3, vocab_size=10)
    session = NgramDraftSession(drafter, vocab_size=16)  # the target's padded vocabulary
    root = session.start(torch.tensor([0, 1]), 2, aux=None)
    assert root.shape == (16,) and int(root.argmax()) == 3 and torch.isneginf(root).sum() == 15
    tree = build_chain(session, root, SpecConfig(steps=5), torch.Generator())
    assert tree.tokens == [3, 4]  # 4 has no continuation: a 2-token chain, not 5
    session.end_round()
    assert build_chain(session, session.extend(torch.tensor([9]), None), SpecConfig(steps=3), None).tokens == []
    with pytest.raises(ValueError, match="chains only"):
        session.expand([-1, -1], torch.tensor([1, 2]))


def test_the_store_round_trips_and_chunked_counting_equals_one_pass(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 20, size=rng.integers(1, 40)) for _ in range(60)]
    whole = count_ngrams(sequences, order=4, vocab_size=20, tokenizer="tok")
    monkeypatch.setattr(ngram_module, "_CHUNK_PAIRS", 7)  # merge partial counts many times
    chunked = count_ngrams(sequences, order=4, vocab_size=20, tokenizer="tok")
    whole.save(tmp_path / "ng")
    loaded = NgramDrafter.load(tmp_path / "ng")
    config = json.loads((tmp_path / "ng" / "config.json").read_text())
    assert config["format"] == NGRAM_FORMAT_TAG and config["order"] == 4 and config["vocab_size"] == 20
    assert is_ngram_dir(tmp_path / "ng") and not is_ngram_dir(tmp_path)
    for other in (chunked, loaded):
        for a, b in zip(whole.tables, other.tables):
            for name in ("keys", "next_ids", "counts", "totals"):
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    histories = [rng.integers(0, 20, size=5).tolist() for _ in range(200)]
    assert [loaded.predict(h) for h in histories] == [whole.predict(h) for h in histories]
    assert sum(p is not None for p in (whole.predict(h) for h in histories)) > 100


def test_out_of_range_ids_and_a_too_low_order_are_refused():
    with pytest.raises(ValueError, match="--order"):
        NgramCounter(1, 10)
    with pytest.raises(ValueError, match=r"0\.\.9"):
        count_ngrams([[1, 10]], order=2, vocab_size=10)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """The 6-layer tiny Llama chat target of megatron_osprey.testing, and one eval split."""
    from megatron_osprey.testing.tiny_models import write_chat_target, write_conversations_jsonl

    root = tmp_path_factory.mktemp("ngram")
    write_chat_target(root / "target", "llama")
    write_conversations_jsonl(root / "chat.jsonl", 4, seed=3)
    return root


def test_conversations_count_assistant_tokens_as_the_template_renders_them(tiny_target):
    from transformers import AutoTokenizer

    from megatron_osprey.data.chat_template import ChatTemplateConfig, ChatTokenizer
    from megatron_osprey.data.conversations import read_conversations
    from megatron_osprey.speculative.ngram_corpus import build_ngram_drafter

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target / "target"))
    drafter = build_ngram_drafter([tiny_target / "chat.jsonl"], tokenizer, order=2)
    chat = ChatTokenizer(tokenizer, ChatTemplateConfig(max_length=None))
    rows = [chat.tokenize(c) for c in read_conversations(tiny_target / "chat.jsonl")]
    assistant = sum(int(r.loss_mask[1:].sum()) for r in rows)
    assert drafter.metadata["counted_tokens"] == assistant > 0
    assert int(drafter.tables[0].totals.sum()) == assistant  # every counted token under its 1-token context
    # The rendered prompt is context only: no user-turn token is counted, so the totals are exactly the above.
    assert drafter.metadata["corpora"][0]["kind"] == "conversations"


def _evaluate(root, out, drafter_dir, *extra):
    from megatron_osprey.stages.evaluate import main

    return main(
        [
            "--target",
            str(root / "target"),
            "--drafter",
            f"ngram={drafter_dir}",
            "--data",
            str(root / "chat.jsonl"),
            "--output",
            str(out),
            "--steps",
            "3",
            "--max-new-tokens",
            "24",
            "--no-progress",
            *extra,
        ]
    )


def test_ngram_stage_then_lossless_eval_on_the_tiny_target(tiny_target, tmp_path, capsys):
    from megatron_osprey.stages.ngram import main as ngram_main

    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("the cat sat on a mat", "two dogs ran past")))
    built = [
        "--input",
        str(text),
        "--input",
        str(tiny_target / "chat.jsonl"),
        "--tokenizer",
        str(tiny_target / "target"),
        "--order",
        "3",
        "--output",
        str(tmp_path / "ng"),
        "--no-progress",
    ]
    assert ngram_main(built) == 0
    assert ngram_main(built) == 2 and "--overwrite" in capsys.readouterr().err
    assert ngram_main([*built, "--overwrite"]) == 0
    assert _evaluate(tiny_target, tmp_path / "first", tmp_path / "ng", "--verify-lossless") == 0
    first = json.loads((tmp_path / "first" / "results.json").read_text())
    assert first["lossless"]["mismatches"] == [] and first["drafters"][0]["variant"] == "ngram"

    # Counted from the target's own greedy outputs, the drafter must be accepted: AL well above 1.
    from transformers import AutoTokenizer

    from megatron_osprey.eval.prompts import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target / "target"))
    prompts = {p.id: p.input_ids.tolist() for p in load_prompts(tiny_target / "chat.jsonl", tokenizer)}
    requests = first["cells"][0]["requests"]
    own = count_ngrams([prompts[r["id"]] + r["output_ids"] for r in requests], 4, len(tokenizer))
    own.save(tmp_path / "own")
    assert _evaluate(tiny_target, tmp_path / "own_eval", tmp_path / "own", "--verify-lossless") == 0
    cell = json.loads((tmp_path / "own_eval" / "results.json").read_text())["cells"][0]
    assert [r["output_ids"] for r in cell["requests"]] == [r["output_ids"] for r in requests]
    assert cell["summary"]["mean_acceptance_length"] > 2.0
    assert cell["summary"]["mean_acceptance_length"] > first["cells"][0]["summary"]["mean_acceptance_length"]
    assert cell["summary"]["drafted_tokens"] > 0 and cell["summary"]["draft_seconds_per_token"] > 0
    matrix = (tmp_path / "own_eval" / "matrix.md").read_text()
    per_token = cell["summary"]["draft_seconds_per_token"] * 1e6
    assert f"| {cell['summary']['mean_acceptance_length']:.3f} |" in matrix and f"| {per_token:.1f} |" in matrix


def test_ngram_drafters_refuse_trees_and_other_tokenizers(tiny_target, tmp_path, capsys):
    count_ngrams([[1, 2, 3]], 3, 400).save(tmp_path / "ng")
    assert _evaluate(tiny_target, tmp_path / "a", tmp_path / "ng", "--topk", "2", "--draft-tokens", "4") == 2
    assert "chains only" in capsys.readouterr().err
    count_ngrams([[1, 2, 3]], 3, 9).save(tmp_path / "small")
    assert _evaluate(tiny_target, tmp_path / "b", tmp_path / "small") == 2
    assert "rebuild it with --tokenizer" in capsys.readouterr().err


def test_ngram_output_never_deletes_an_input_or_a_directory_it_did_not_write(tiny_target, tmp_path, capsys):
    from megatron_osprey.stages.ngram import main as ngram_main

    corpus = tmp_path / "corpora" / "text.jsonl"
    corpus.parent.mkdir()
    corpus.write_text(json.dumps({"text": "the cat sat on a mat"}) + "\n")

    def build(output, *extra, corpus=corpus):
        argv = ["--input", str(corpus), "--tokenizer", str(tiny_target / "target"), "--output", str(output)]
        return ngram_main([*argv, "--order", "2", "--no-progress", *extra])

    # An output holding (or equal to) an input is refused, even with --overwrite, and nothing is deleted.
    for output in (corpus.parent, tmp_path):
        assert build(output, "--overwrite") == 2
        err = capsys.readouterr().err
        assert f"contains the input --input {corpus}" in err and len(err.splitlines()) == 1
    assert corpus.is_file()
    assert build(tiny_target / "target", "--overwrite") == 2
    assert f"is the input --tokenizer ({tiny_target / 'target'})" in capsys.readouterr().err
    # A directory another program wrote, even one holding an n-gram table the stage did not record.
    count_ngrams([[1, 2, 3]], 2, 400).save(tmp_path / "theirs")
    assert build(tmp_path / "theirs", "--overwrite") == 2
    assert f"--output {tmp_path / 'theirs'} is not empty and has no provenance.json" in capsys.readouterr().err
    assert is_ngram_dir(tmp_path / "theirs")
    # Its own earlier output is replaced with --overwrite, files it no longer writes included.
    assert build(tmp_path / "mine") == 0
    (tmp_path / "mine" / "stale.txt").write_text("from an earlier run")
    assert build(tmp_path / "mine") == 2 and "pass --overwrite" in capsys.readouterr().err
    assert build(tmp_path / "mine", "--overwrite") == 0
    assert is_ngram_dir(tmp_path / "mine") and not (tmp_path / "mine" / "stale.txt").exists()
    # But not when an input lies inside it.
    inside = tmp_path / "mine" / "more.jsonl"
    inside.write_text(corpus.read_text())
    assert build(tmp_path / "mine", "--overwrite", corpus=inside) == 2
    assert f"contains the input --input {inside}" in capsys.readouterr().err and inside.is_file()


def test_an_ngram_table_killed_midway_is_refused_by_evaluate_and_cleaned_by_overwrite(tiny_target, tmp_path, capsys):
    from megatron_osprey.stages.ngram import main as ngram_main
    from tests.unit.test_export import run_killed_before_record

    out = tmp_path / "ng"
    argv = ["--input", str(tiny_target / "chat.jsonl"), "--tokenizer", str(tiny_target / "target")]
    argv += ["--order", "2", "--output", str(out), "--no-progress"]
    assert run_killed_before_record("ngram", argv) == 9
    assert is_ngram_dir(out) and not (out / "provenance.json").exists()
    assert _evaluate(tiny_target, tmp_path / "eval", out) == 2
    error = capsys.readouterr().err.splitlines()[-1]  # the input check names it before the drafter is loaded
    assert error == (
        f"error: input drafter:ngram {out} lies in {out}, a partial ngram output: that stage stopped before it "
        f"finished writing it (.osprey-writing.json is still there). Run the ngram stage again with --overwrite."
    )
    assert ngram_main([*argv, "--overwrite"]) == 0  # its own partial output
    assert (out / "provenance.json").is_file() and not (out / ".osprey-writing.json").exists()
