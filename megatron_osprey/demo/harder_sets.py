"""The harder eval sets of the demo's extra arms, made from the first training domain's held-out prompts:

- template perturbation and long context (`python -m megatron_osprey.data.eval_variants`, one logged step);
- translation and story prompts for the first cfg.task_languages of TASK_LANGUAGES: an English held-out prompt to
  translate into the language, or to continue as a short story written in it (the multilingual paper's two tasks:
  translation from English into the language, and story generation, held out from its task fine-tuning).

The translation fine-tuning arm (osprey_translation) trains on translation_rows() of the *training* prompts.

They are evaluated with `--prompt-messages before_assistant`, so the perturbed set's system prompt is sent.
"""

from __future__ import annotations

import time
from pathlib import Path

from megatron_osprey.demo.sizes import DemoConfig
from megatron_osprey.demo.step_runner import StepRunner

# The task languages: the five of the monolingual corpora (recipes/cpu.py MONOLINGUAL_LANGUAGES) first, then six
# more that the same pinned wheel (chatterbot-corpus 1.3.3: chatterbot_corpus/data/<language>/) holds text for, so
# that 11 languages are evaluated as in the multilingual paper (Paudel et al. 2026, "Speculative Decoding Across
# Languages"), whose own list of 11 is not among the pinned files.
TASK_LANGUAGES = ("spanish", "french", "german", "italian", "portuguese")
TASK_LANGUAGES += ("dutch", "ukrainian", "turkish", "chinese", "japanese", "korean")
TASKS = {
    "translation": "Translate the following text into {language}. Reply with the translation only.\n\n{text}",
    "story": "Write a short story in {language} that begins with this line:\n\n{text}",
}


def task_rows(prompts: list[tuple[str, str]], languages: tuple[str, ...], per_language: int) -> dict[str, list]:
    """Per task, `per_language` rows per language; each language takes the next prompts in turn, so the
    languages see different source texts while the prompts last."""
    if not prompts:
        raise ValueError("the harder sets need at least one held-out prompt.")
    out = {}
    for task, template in TASKS.items():
        rows = []
        for li, language in enumerate(languages):
            for j in range(per_language):
                source_id, text = prompts[(li * per_language + j) % len(prompts)]
                content = template.format(language=language.capitalize(), text=text)
                turn = {"role": "user", "content": content}
                rows.append({"id": f"{task}-{language}-{j}-{source_id}", "conversations": [turn]})
        out[task] = rows
    return out


def translation_rows(prompts: list[tuple[str, str]], languages: tuple[str, ...]) -> list[dict]:
    """One translation request per prompt (the languages in turn): the task fine-tuning arm's prompts, which the
    target then answers (regenerates), as it answers the base arms' training prompts."""
    if not prompts or not languages:
        raise ValueError("the translation fine-tuning arm needs training prompts and at least one language.")
    rows = []
    for i, (source_id, text) in enumerate(prompts):
        language = languages[i % len(languages)]
        content = TASKS["translation"].format(language=language.capitalize(), text=text)
        rows.append(
            {"id": f"translation-{language}-{source_id}", "conversations": [{"role": "user", "content": content}]}
        )
    return rows


def write_translation_prompts(cfg: DemoConfig, train_path: Path, output: Path) -> Path:
    """The translation fine-tuning arm's prompts (conversations JSONL) from a training split: as many as it has."""
    from megatron_osprey.data.conversations import read_conversations
    from megatron_osprey.demo.corpora import write_jsonl
    from megatron_osprey.eval.prompts import prompt_messages

    prompts = [(c.id, prompt_messages(c.messages)[0]["content"]) for c in read_conversations(train_path)]
    return write_jsonl(output, translation_rows(prompts, TASK_LANGUAGES[: cfg.task_languages]))


def write_task_sets(cfg: DemoConfig, eval_path: Path, out_dir: Path) -> list[Path]:
    """translation.jsonl and story.jsonl in out_dir from the held-out eval set at eval_path."""
    from megatron_osprey.data.conversations import read_conversations
    from megatron_osprey.demo.corpora import write_jsonl
    from megatron_osprey.eval.prompts import prompt_messages

    prompts = [(c.id, prompt_messages(c.messages)[0]["content"]) for c in read_conversations(eval_path)]
    rows = task_rows(prompts, TASK_LANGUAGES[: cfg.task_languages], cfg.task_prompts_per_language)
    return [write_jsonl(out_dir / f"{task}.jsonl", rows[task]) for task in TASKS]


def build_harder_sets(steps: StepRunner, cfg: DemoConfig, output: Path, data: dict, target: Path) -> list[Path]:
    """The harder sets' files: perturbed, long context, translation, story."""
    domain = cfg.train_domains[0]
    source = data["splits"][domain]["eval"]
    out_dir = output / "data" / "harder"
    steps.run(
        "eval_variants",
        ["-m", "megatron_osprey.data.eval_variants", "--input", source, "--tokenizer", target]
        + ["--output-dir", out_dir, "--max-context-tokens", str(cfg.long_context_tokens), "--seed", str(cfg.seed)],
    )
    began = time.time()
    tasks = write_task_sets(cfg, source, out_dir)
    steps.timed("task_prompts", time.time() - began)
    return [out_dir / f"{domain}.perturbed.jsonl", out_dir / f"{domain}.long_context.jsonl", *tasks]


# The paper's public benchmarks a registry package ships (the others need their files): evaluated beside the
# demo's own domains, on seed 0's drafters.
OFFLINE_SUITES = ("humaneval",)


def build_suite_sets(steps: StepRunner, cfg: DemoConfig, output: Path) -> list[Path]:
    """The offline benchmark suites as eval sets (`osprey suite`), their first n_eval prompts each."""
    out_dir = output / "data" / "suites"
    paths = []
    for suite in OFFLINE_SUITES:
        path = out_dir / f"{suite}.jsonl"
        argv = ["-m", "megatron_osprey", "suite", "--suite", suite, "--source", "package", "--output", path]
        steps.run(f"suite_{suite}", argv + ["--limit", str(cfg.n_eval), "--overwrite"])
        paths.append(path)
    return paths
