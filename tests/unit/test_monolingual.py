"""The monolingual Stage-2 recipes: one per corpus language, reading the text the monolingual writer produces, and
a GPU template on a user's corpus; the writer keeps to one language and out of the eval sets."""

from __future__ import annotations

import json

import pytest

from launcher.plan import make_plan
from megatron_osprey.demo.corpus_sources import CHATTERBOT_LANGUAGES, chatterbot_dialogues
from megatron_osprey.demo.monolingual import main, monolingual_documents, write_monolingual_text
from megatron_osprey.recipes import RECIPES, get_recipe, resolve_recipe
from megatron_osprey.recipes.cpu import MONOLINGUAL_LANGUAGES

GPU = "qwen3_4b_backbone_monolingual_pretrain_10k_64gpu_h100_bf16"


def _lines(language: str) -> set[str]:
    return {line for dialogue in chatterbot_dialogues()[language] for line in dialogue}


def test_a_cpu_recipe_per_corpus_language_pretrains_on_that_languages_text(tmp_path):
    assert len(MONOLINGUAL_LANGUAGES) >= 3 and set(MONOLINGUAL_LANGUAGES) <= set(CHATTERBOT_LANGUAGES) - {"english"}
    for language in MONOLINGUAL_LANGUAGES:
        name = f"smollm2_cpu_monolingual_{language}_pretrain"
        assert name in RECIPES
        recipe = get_recipe(name)
        assert recipe.chain == ("prune", "preprocess", "pretrain") and recipe.hardware == "cpu"
        assert recipe.config("preprocess", str(tmp_path)).input == f"smollm2_runs/data/monolingual/{language}.jsonl"
        pretrain = recipe.config("pretrain", str(tmp_path))
        assert pretrain.data.data_path == [recipe.config("preprocess", str(tmp_path)).output_path()]
        assert make_plan(recipe, "pretrain").to_json()["fits"]


def test_the_gpu_template_reads_the_users_corpus_and_names_its_language(tmp_path):
    recipe = get_recipe(f"{GPU}:swahili")
    assert recipe.run_name.endswith("_swahili") and recipe.source == "qwen3_4b"
    assert recipe.config("preprocess", str(tmp_path)).input.endswith("data/monolingual/swahili.jsonl")
    assert recipe.stage_resources("preprocess").array_tasks == 1
    own = resolve_recipe(f"{GPU}:swahili", ["paths.pretrain_text=/corpora/sw.jsonl"])
    assert own.config("preprocess", str(tmp_path)).input == "/corpora/sw.jsonl"
    plan = make_plan(own, "pretrain").to_json()
    assert plan["fits"] and plan["train_iters"] == 10_000


@pytest.mark.parametrize("language", MONOLINGUAL_LANGUAGES[:3])
def test_the_writer_keeps_to_the_requested_language(language, tmp_path):
    path = write_monolingual_text(language, tmp_path / f"{language}.jsonl")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert rows and all(set(row) == {"text"} and row["text"].strip() for row in rows)
    written = {line for row in rows for line in row["text"].splitlines()}
    own = _lines(language)
    others = set().union(*(_lines(other) for other in CHATTERBOT_LANGUAGES if other != language))
    assert written <= own and not (written & others)
    # Nothing else is dropped: every dialogue left with two lines of the language's own is written.
    kept = [[line for line in d if line not in others] for d in chatterbot_dialogues()[language]]
    assert written == {line for lines in kept if len(lines) >= 2 for line in lines}


def test_the_writer_leaves_out_dialogues_of_the_eval_sets(tmp_path):
    language = MONOLINGUAL_LANGUAGES[0]
    everything = monolingual_documents(language)
    held = next(line for document in everything for line in document.splitlines() if len(line) >= 20)
    eval_row = {
        "id": "ml-0",
        "conversations": [{"role": "user", "content": held}, {"role": "assistant", "content": "x"}],
    }
    eval_path = tmp_path / "multilingual.jsonl"
    eval_path.write_text(json.dumps(eval_row) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    assert main(["--language", language, "--output", str(out), "--exclude-eval", str(eval_path)]) == 0
    kept = [json.loads(line)["text"] for line in out.read_text(encoding="utf-8").splitlines()]
    assert all(held not in text for text in kept)
    assert 0 < len(kept) < len(everything)
    with pytest.raises(ValueError, match="--language 'klingon'"):
        monolingual_documents("klingon")
