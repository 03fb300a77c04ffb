"""The demo's extra arms (`--arms`, all of them in `make demo-full`), each beside Osprey and EAGLE-3 on the same
regenerated data, hidden-state store, optimizer, tokens and seeds, changing one named thing:

- the paper's ablation: a parameter-matched 2-layer EAGLE-3 from scratch, and Osprey with 0 Stage-2 steps;
- the loss: Osprey trained with SpecForge's per-sample normalisation (`--ttt-normalization reference`) and with
  its loss-mask alignment (`--ttt-mask-alignment reference`);
- attention drift: post-norm hidden states and per-hidden-state RMSNorm, for Osprey and for EAGLE-3, and
  EAGLE-3 with and without them trained with 3 TTT steps where it drafts chains of 5;
- Draft-OPD as its authors run it: from the SFT Osprey drafter, rounds of greedy rollouts on the training prompts
  with the drafter as the last update left it, one update each; and its equal-compute control, Osprey SFT trained
  as many more updates;
- n-gram drafters: on the training domain's regenerated conversations, and on the monolingual corpora;
- Osprey after a monolingual Stage-2 pass over the monolingual corpora' languages;
- the multilingual paper's task-specific fine-tuning: Osprey distilled on the target's translations of the
  training prompts into the task languages (harder_sets.TASK_LANGUAGES), as many conversations as the base arm:
  one drafter for all the languages together, where the paper fine-tunes one per language (5 or 11 more
  distillations and regenerations for one arm on a CPU).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from megatron_osprey.demo.arms import backbone_steps, drafter_name, preprocess_general
from megatron_osprey.demo.commands import distill_argv, on_policy_argv, opd_updates
from megatron_osprey.demo.sizes import DemoConfig
from megatron_osprey.demo.step_runner import StepRunner

# What each offline-distilled arm passes: its drafter init (an Osprey init's name; None: EAGLE-3 from scratch)
# and the flags that name its one change.
OFFLINE_ARMS = {
    "eagle3_2layer": (None, ("--eagle3-num-layers", "2")),
    "osprey_no_stage2": ("osprey_no_stage2", ()),
    "osprey_ttt_reference": ("osprey", ("--ttt-normalization", "reference")),
    "osprey_ttt_mask_reference": ("osprey", ("--ttt-mask-alignment", "reference")),
    "osprey_drift": ("osprey", ("--hidden-post-norm", "--aux-hidden-norm")),
    "eagle3_drift": (None, ("--hidden-post-norm", "--aux-hidden-norm")),
    "eagle3_ttt3": (None, ("--ttt-steps", "3")),
    "eagle3_drift_ttt3": (None, ("--hidden-post-norm", "--aux-hidden-norm", "--ttt-steps", "3")),
    "osprey_monolingual": ("osprey_monolingual", ()),
    "osprey_stage2_more": ("osprey_stage2_more", ()),
}
# The neural arms trained outside OFFLINE_ARMS: Draft-OPD, its equal-compute SFT control, the translation arm.
OTHER_NEURAL_ARMS = ("osprey_opd", "osprey_sft_more", "osprey_translation")
# The neural arms are evaluated in groups, one set of steps each (eval_dir/<group>), so that a group added to
# a finished run leaves the evaluations of the others as they were; the harder sets and the benchmark suites
# take the first group's arms (the TTT-depth arms test chains longer than training, on the eval domains).
EVAL_GROUPS = {"arms_ttt_depth": ("eagle3_ttt3", "eagle3_drift_ttt3")}
FIRST_GROUP = "arms"
NGRAM_ORDER = 4
SENT = "before_assistant"  # the harder sets' prompts: every message before the first reply (system prompts too)


def monolingual_corpus(cfg: DemoConfig, output: Path, data: dict) -> Path:
    """Every monolingual corpus's text in one JSONL, with no message of any eval set in it."""
    from megatron_osprey.demo.corpora import write_jsonl
    from megatron_osprey.demo.monolingual import write_monolingual_text
    from megatron_osprey.recipes.cpu import MONOLINGUAL_LANGUAGES

    path = output / "data" / "monolingual.jsonl"
    if not path.is_file():  # written atomically: a file here is whole
        evals = [data["splits"][d]["eval"] for d in cfg.domains()]
        rows = []
        for language in MONOLINGUAL_LANGUAGES:
            part = write_monolingual_text(language, output / "data" / "monolingual" / f"{language}.jsonl", evals)
            rows += [json.loads(line) for line in part.read_text(encoding="utf-8").splitlines() if line.strip()]
        write_jsonl(path, rows)
    return path


def extra_backbones(
    steps: StepRunner, cfg: DemoConfig, output: Path, data: dict, target: Path, inits: dict[str, Path]
) -> dict[str, Path]:
    """Stage 1-3 of the extra Osprey arms: adapt the pruned backbone without Stage 2, and a monolingual Stage-2
    pass continued from the Stage-2 backbone (converted back to a pruned backbone by the prune stage)."""
    inits = dict(inits)
    if "osprey_no_stage2" in cfg.arms:
        init = output / "drafter_init_no_stage2"
        steps.run(
            "adapt_no_stage2",
            ["tools/adapt_drafter.py", "--backbone", output / "pruned_target", "--target", target, "--output", init]
            + ["--overwrite"],
        )
        inits["osprey_no_stage2"] = init
    if "osprey_monolingual" in cfg.arms or "ngram_monolingual" in cfg.arms:
        began = time.time()
        data["monolingual"] = monolingual_corpus(cfg, output, data)
        steps.timed("monolingual_corpus", time.time() - began)
    stage2 = output / "backbone_target" / "hf"  # both passes continue from the Stage-2 backbone
    if "osprey_monolingual" in cfg.arms:
        prefix = preprocess_general(steps, output, data, target, "monolingual", source=data["monolingual"])
        inits["osprey_monolingual"] = backbone_steps(
            steps, cfg, output, stage2, prefix, target, "monolingual", iters=cfg.monolingual_iters
        )
    if "osprey_stage2_more" in cfg.arms:  # its control: as many more steps on the general mix
        prefix = output / "data" / "general_target"  # preprocessed by the base arm
        inits["osprey_stage2_more"] = backbone_steps(
            steps, cfg, output, stage2, prefix, target, "stage2_more", iters=cfg.monolingual_iters
        )
    return inits


def _on_policy(
    steps: StepRunner, cfg: DemoConfig, output: Path, target: Path, data: dict, domain: str, seed: int, sft: Path
) -> dict:
    """Draft-OPD's online loop from the SFT Osprey drafter on the domain's first training prompts (one job: each
    round rolls out with the drafter the last update left, then updates on the round)."""
    name = drafter_name("osprey_opd", domain, seed, cfg)
    save = output / "drafters" / name
    prompts = data["splits"][domain]["train"]
    steps.run(f"distill_{name}", on_policy_argv(cfg, sft, target, domain, prompts, save, seed))
    return {"name": name, "method": "osprey_opd", "domain": domain, "seed": seed, "path": save}


def translation_data(
    steps: StepRunner, cfg: DemoConfig, output: Path, data: dict, target: Path, vllm_python=None, serve=True
) -> dict[str, tuple[Path, Path]]:
    """The translation fine-tuning arm's data per training domain: its training prompts as translation requests
    into the task languages, answered by the target as the base arm's prompts are (same engine and settings), and
    the hidden-state store on them; {domain: (conversations, store)}."""
    from megatron_osprey.demo.arms import regenerate_one, regeneration_server
    from megatron_osprey.demo.harder_sets import write_translation_prompts

    served = regeneration_server(vllm_python, serve)
    out = {}
    for domain in cfg.train_domains:
        name = f"translation_{domain}"
        prompts = output / "data" / f"{name}_prompts.jsonl"
        if not prompts.is_file():  # written atomically: a file here is whole
            write_translation_prompts(cfg, data["splits"][domain]["train"], prompts)
        out[domain] = regenerate_one(steps, cfg, output, name, prompts, target, served)
    return out


def _ngram(steps: StepRunner, output: Path, target: Path, method: str, corpus: Path, domain: str) -> dict:
    """An n-gram drafter counted over `corpus` (its train domain: `domain`)."""
    name = f"{method}_{domain}"
    path = output / "drafters" / name
    steps.run(
        name,
        ["-m", "megatron_osprey", "ngram", "--input", corpus, "--tokenizer", target, "--order", str(NGRAM_ORDER)]
        + ["--output", path, "--no-progress", "--overwrite"],
    )
    return {"name": name, "method": method, "domain": domain, "seed": 0, "path": path, "ngram": True}


def extra_drafters(
    steps: StepRunner,
    cfg: DemoConfig,
    output: Path,
    target: Path,
    inits: dict[str, Path],
    regenerated: dict[str, Path],
    stores: dict[str, Path],
    data: dict,
) -> list[dict]:
    """Every extra arm's drafter per training domain and seed (n-gram drafters once: they have no seed)."""
    from transformers import AutoConfig

    draft_vocab = cfg.draft_vocab_size(AutoConfig.from_pretrained(target).vocab_size)
    drafters = []
    for seed in cfg.seeds[: cfg.arm_seeds]:
        for domain in cfg.train_domains:
            for arm in (a for a in cfg.arms if a in OFFLINE_ARMS):
                init_name, extra = OFFLINE_ARMS[arm]
                name = drafter_name(arm, domain, seed, cfg)
                save = output / "drafters" / name
                init = inits[init_name] if init_name else None
                argv = distill_argv(
                    cfg, arm, init, target, domain, regenerated[domain], stores[domain], save, seed, draft_vocab, extra
                )
                steps.run(f"distill_{name}", argv)
                drafters.append({"name": name, "method": arm, "domain": domain, "seed": seed, "path": save})
            if "osprey_opd" in cfg.arms:
                sft = output / "drafters" / drafter_name("osprey", domain, seed, cfg)
                drafters.append(_on_policy(steps, cfg, output, target, data, domain, seed, sft))
            inputs = {"osprey_sft_more": (regenerated[domain], stores[domain], opd_updates(cfg))}
            if "osprey_translation" in cfg.arms:
                inputs["osprey_translation"] = (*data["translation"][domain], 0)
            for arm, (conversations, store, more) in inputs.items():
                if arm not in cfg.arms:
                    continue
                name = drafter_name(arm, domain, seed, cfg)
                save = output / "drafters" / name
                argv = distill_argv(
                    cfg, arm, inits["osprey"], target, domain, conversations, store, save, seed, draft_vocab,
                    extra_iters=more,
                )  # fmt: skip
                steps.run(f"distill_{name}", argv)
                drafters.append({"name": name, "method": arm, "domain": domain, "seed": seed, "path": save})
    if "ngram" in cfg.arms:
        drafters += [_ngram(steps, output, target, "ngram", regenerated[d], d) for d in cfg.train_domains]
    if "ngram_monolingual" in cfg.arms:
        drafters.append(_ngram(steps, output, target, "ngram_monolingual", data["monolingual"], "multilingual"))
    return drafters


def eval_group(method: str) -> str:
    """The evaluation group (eval_dir/<group>, steps eval_<group>*) of an extra neural arm."""
    return next((group for group, methods in EVAL_GROUPS.items() if method in methods), FIRST_GROUP)


def combine_evaluations(cfg: DemoConfig, dirs: list[Path], out_dir: Path) -> Path:
    """One results.json (and live check) in out_dir from the base arms' evaluation and the extra arms' groups."""
    import json

    from megatron_osprey.eval.run import merge_results

    def load(d: Path) -> dict:
        return json.loads((d / "results.json").read_text())

    merge_results([load(d) for d in dirs], out_dir)
    if cfg.eval_replay:
        merge_results([load(d / "live_check") for d in dirs], out_dir / "live_check")
    return out_dir


def evaluate_extra(
    steps: StepRunner,
    cfg: DemoConfig,
    target: Path,
    eval_dir: Path,
    base: list[dict],
    extra: list[dict],
    data: dict,
    harder: list[Path],
    suites: list[Path],
) -> Path:
    """The extra neural arms on the eval domains (their own steps per EVAL_GROUPS group, merged with the base
    arms' results into eval_dir/combined, which it returns); seed 0's drafters of the first group on the harder
    sets (system prompts sent) and on the offline benchmark suites; and the n-gram drafters at batch 1 (their
    engine: the reference chain decoder) on the eval domains and the harder sets, lossless-checked."""
    import dataclasses

    from megatron_osprey.demo.arms import evaluate_drafters
    from megatron_osprey.demo.commands import eval_argv

    neural = [d for d in extra if not d.get("ngram")]
    ngrams = [d for d in extra if d.get("ngram")]
    results_dir, groups = eval_dir, {}
    for drafter in neural:
        groups.setdefault(eval_group(drafter["method"]), []).append(drafter)
    for group, drafters in groups.items():
        evaluate_drafters(steps, cfg, target, eval_dir / group, drafters, data, name=f"eval_{group}")
    if groups:
        results_dir = combine_evaluations(cfg, [eval_dir, *(eval_dir / g for g in groups)], eval_dir / "combined")
    seed0 = [d for d in base + groups.get(FIRST_GROUP, []) if d["seed"] == cfg.seeds[0]]
    replay = cfg.eval_replay
    steps.run("eval_harder", eval_argv(cfg, target, eval_dir / "harder", seed0, data, replay, None, harder, SENT))
    if suites:  # the paper's public benchmarks that ship offline, first user turn as the paper sends it
        steps.run("eval_suites", eval_argv(cfg, target, eval_dir / "suites", seed0, data, replay, None, suites))
    if ngrams:
        batch1 = dataclasses.replace(cfg, eval_batch=1)
        limit = cfg.live_check_prompts if cfg.eval_replay else None  # live decoding at batch 1 costs the most
        steps.run("eval_ngram", eval_argv(batch1, target, eval_dir / "ngram", ngrams, data, limit=limit))
        steps.run(
            "eval_ngram_harder",
            eval_argv(batch1, target, eval_dir / "ngram_harder", ngrams, data, False, limit, harder, SENT),
        )
    return results_dir
