"""The AL benchmark: every drafter on every eval split against one HF target; writes results and the matrix.

`config` is the evaluate stage's EvaluateConfig (stages/evaluate.py).
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from megatron_osprey.base.atomic_io import write_text_atomic
from megatron_osprey.base.checksums import skipped_checksum_note
from megatron_osprey.eval import benchmark
from megatron_osprey.eval.checks import (
    check_drafter_fits_target,
    check_engine,
    check_ngram_drafters,
    check_ngram_fits_target,
    check_target_fits,
    fit_prompts,
    recorded_target_warning,
)
from megatron_osprey.eval.config import DrafterSpec  # noqa: F401  (the drafters a run names)
from megatron_osprey.eval.loading import load_drafter, target_facts
from megatron_osprey.eval.matrix import Cell, build_matrices, matrix_markdown, plot_matrices, summarize
from megatron_osprey.eval.prompts import follow_up, load_prompts
from megatron_osprey.speculative import HFTargetModel, SpecConfig
from megatron_osprey.speculative.ngram import NgramDrafter

RESULTS_TAG = "megatron_osprey.eval/1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def sweep_settings(config) -> list[dict]:
    """One SpecConfig keyword set per (temperature, draft tokens) combination, in flag order.

    With topk 1 a chain of d draft tokens has d - 1 steps (SGLang's rule), so each --draft-tokens
    value sets the steps; with topk > 1 --steps stays and the draft tokens choose the tree's size.
    """
    settings = []
    for temperature in _as_list(config.temperature):
        for draft_tokens in _as_list(config.draft_tokens):
            steps = config.steps
            if config.topk == 1 and draft_tokens is not None:
                steps = int(draft_tokens) - 1
            settings.append(
                dict(
                    steps=steps,
                    topk=config.topk,
                    draft_tokens=draft_tokens,
                    temperature=float(temperature),
                    max_new_tokens=config.max_new_tokens,
                    seed=config.seed,
                )
            )
    return settings


# Target layers an n-gram drafter's target taps: the target adapters always return aux features, and an
# n-gram drafter ignores them, so the cheapest valid choice.
NGRAM_AUX_LAYERS = [0, 0, 0]


DATA_SUFFIXES = (".jsonl", ".json")


def split_names(paths: list[Path]) -> list[str]:
    """Each split is named by its file name less its data suffix (``code.jsonl`` -> ``code``,
    ``chat.perturbed.jsonl`` -> ``chat.perturbed``); names must be distinct."""
    names = []
    for p in paths:
        name = Path(p).name
        for suffix in DATA_SUFFIXES:
            if name.endswith(suffix) and len(name) > len(suffix):
                name = name[: -len(suffix)]
                break
        names.append(name)
    if len(set(names)) != len(names):
        raise ValueError(f"--data files must have distinct stems (split names), got {names}.")
    return names


def _domain_from_run_config(run_config: dict) -> str | None:
    for key in ("train_domain", "domain"):
        if isinstance(run_config.get(key), str):
            return run_config[key]
    data = run_config.get("data")
    if isinstance(data, dict) and isinstance(data.get("domain"), str):
        return data["domain"]
    return None


def _eos_ids(target_dir: Path, generation_config, tokenizer) -> tuple[int, ...]:
    ids = generation_config.eos_token_id if generation_config is not None else None
    ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def _load_target(config):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = Path(config.target)
    if not (target / "config.json").is_file():
        raise FileNotFoundError(f"--target {target}: no config.json there (a HF model directory is expected).")
    if config.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {config.dtype!r}.")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
    if config.target_backend not in ("hf", "megatron"):
        raise ValueError(f"--target-backend must be hf or megatron, got {config.target_backend!r}.")
    if config.target_backend == "megatron":
        _check_megatron_target(config, device)
    check_target_fits(config, device)  # from config.json alone, before any weight is read
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    if config.target_backend == "megatron":
        return None, tokenizer, "cpu"
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=DTYPES[config.dtype]).to(device).eval()
    return model, tokenizer, device


MEGATRON_DTYPES = ("float32", "bfloat16", "float16")


def _check_megatron_target(config, device: str) -> None:
    """What --target-backend megatron cannot run, refused naming evaluate's own flags before anything loads."""
    from megatron_osprey.base.arch import load_target_config
    from megatron_osprey.base.hardware import have_transformer_engine

    if config.dtype not in MEGATRON_DTYPES:
        raise ValueError(
            f"--dtype {config.dtype} with --target-backend megatron: Megatron-Core builds the target in "
            f"{', '.join(MEGATRON_DTYPES)}; pick one, or use --target-backend hf."
        )
    try:
        arch = load_target_config(config.target)
    except ValueError:
        return
    if arch.is_moe and device != "cpu" and not have_transformer_engine():
        raise ValueError(
            f"--target {config.target} is a mixture-of-experts model, which --target-backend megatron runs on CUDA "
            "only with Transformer Engine (megatron-core's MoE router calls TE's GEMM): install it "
            "(pip install -e '.[gpu]') or use --target-backend hf."
        )


@contextlib.contextmanager
def _target_factory(config, model):
    """Yields make(aux_layer_ids) -> TargetModel, for the HF model or a Megatron-Core stage."""
    if model is not None:
        yield lambda aux: HFTargetModel(model, aux)
        return
    from megatron_osprey.models.target.megatron_decoding import MegatronTargetModel
    from megatron_osprey.models.target.pipeline_stage import load_target
    from megatron_osprey.parallel import ParallelConfig, parallel_context

    with parallel_context(ParallelConfig()) as state:
        # At --dtype, with TE on a GPU where it is installed (the spec a MoE target needs there), else local.
        stage = load_target(
            config.target, state.config, state.device, params_dtype=DTYPES[config.dtype], with_lm_head=True
        )
        yield lambda aux: MegatronTargetModel(stage.model, aux, stage.arch.vocab_size)


# Fields of the evaluate stage's config that results.json lists elsewhere (drafters, splits) or not at all.
_NOT_RECORDED = ("drafters", "names", "train_domain", "method", "data", "extra")


def run_eval(config) -> dict:
    """Run the benchmark and write OUTPUT/results.json, matrix.md and matrix.png; returns the results."""
    settings, splits = _check_request(config)
    model, tokenizer, device = _load_target(config)
    target_config, generation_config = target_facts(config, model)
    eos = _eos_ids(config.target, generation_config, tokenizer)
    specs = [SpecConfig(**kw, eos_token_ids=eos) for kw in settings]
    prompts, truncated = _load_split_prompts(config, splits, tokenizer, target_config, specs)
    drafters, warnings = _load_drafters(config, tokenizer, target_config)
    cells, cell_records, mismatches = _run_sweep(
        config, model, device, target_config, drafters, specs, splits, prompts, tokenizer
    )
    sweep = [{**_setting(spec), "matrices": build_matrices(cells[i], splits)} for i, spec in enumerate(specs)]
    results = {
        "format": RESULTS_TAG,
        "config": _recorded_config(config, eos, specs[0]),
        "drafters": _drafter_records(drafters, warnings),
        "splits": [
            {"name": s, "path": str(p), "requests": len(prompts[s]), "truncated_prompts": truncated[s]}
            for s, p in zip(splits, config.data)
        ],
        "cells": cell_records,
        "matrices": sweep[0]["matrices"],  # the first combination (the only one without a sweep)
        "sweep": sweep,
        "lossless": {"checked": config.verify_lossless, "mismatches": mismatches},
    }
    write_results(results, Path(config.output))
    return results


def _check_request(config) -> tuple[list[dict], list[str]]:
    """Every flag checked before any loading; returns the sweep's SpecConfig keyword sets and the split names."""
    settings = sweep_settings(config)
    if config.verify_lossless and any(kw["temperature"] != 0 for kw in settings):
        raise ValueError("--verify-lossless compares greedy outputs token by token; it needs --temperature 0.")
    for kw in settings:
        SpecConfig(**kw)  # validate every draft shape before any loading
    check_engine(config, settings)
    check_ngram_drafters(config)
    splits = split_names(config.data)
    names = [d.name for d in config.drafters]
    if len(set(names)) != len(names):
        raise ValueError(f"--drafter names must be distinct, got {names}.")
    results_path = Path(config.output) / "results.json"
    if results_path.exists() and not config.overwrite:
        raise FileExistsError(
            f"--output {config.output}: {results_path} already exists; pass --overwrite to "
            f"replace it, or choose another --output."
        )
    return settings, splits


def _load_split_prompts(config, splits, tokenizer, target_config, specs) -> tuple[dict, dict]:
    """Each split's prompts, fitted to the target's context: ({split: prompts}, {split: truncated count})."""
    prompts, truncated = {}, {}
    for name, path in zip(splits, config.data):
        loaded_prompts = load_prompts(path, tokenizer, config.limit, config.enable_thinking, config.prompt_messages)
        prompts[name], truncated[name] = fit_prompts(
            loaded_prompts,
            path,
            config,
            getattr(target_config, "max_position_embeddings", None),
            max(spec.draft_tokens for spec in specs),
        )
    return prompts, truncated


def _load_drafters(config, tokenizer, target_config) -> tuple[list[tuple], dict]:
    """Each --drafter loaded and checked against the target: ([(item, loaded, domain, method)], {name: warning})."""
    drafters, warnings = [], {}
    for item in config.drafters:
        loaded = load_drafter(item.path, verify=not config.skip_checksum)
        if config.skip_checksum and loaded.source == "megatron":
            print(skipped_checksum_note(item.path), file=sys.stderr, flush=True)
        if isinstance(loaded.drafter, NgramDrafter):
            check_ngram_fits_target(item.path, loaded.drafter, config.target, tokenizer)
        else:
            check_drafter_fits_target(item.path, loaded.drafter.config, config.target, target_config)
        warning = recorded_target_warning(item.path, loaded.run_config, config.target)
        if warning:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
            warnings[item.name] = warning
        domain = item.train_domain or _domain_from_run_config(loaded.run_config)
        drafters.append((item, loaded, domain, item.method or _variant(loaded.drafter)))
    return drafters, warnings


def _run_sweep(config, model, device, target_config, drafters, specs, splits, prompts, tokenizer) -> tuple:
    """Every drafter on every setting and split: (cells per setting, cell records, lossless mismatches)."""
    from tqdm import tqdm

    total = len(specs) * len(drafters) * sum(len(p) for p in prompts.values())
    cells = [[] for _ in specs]
    cell_records, mismatches = [], []
    references = {split: {} for split in splits}  # target-only decodes, shared by the drafters
    features = {split: {} for split in splits}  # --replay: the target's features over prompt + output
    progress_done = 0  # requests finished (tqdm's own count stays 0 when the bar is off)
    with (
        tqdm(total=total, desc="eval", unit="req", disable=not config.progress) as progress,
        _target_factory(config, model) as make_target,
    ):
        for item, loaded, domain, method in drafters:
            if isinstance(loaded.drafter, NgramDrafter):
                drafter, aux = loaded.drafter, NGRAM_AUX_LAYERS
            else:
                drafter = loaded.drafter.to(device=device, dtype=DTYPES[config.dtype])
                aux = list(drafter.config.aux_layer_ids)
            target = make_target(aux)
            session = benchmark.make_session(drafter, target_config.vocab_size)
            for index, spec in enumerate(specs):
                for split in splits:
                    progress.set_description(f"{item.name} on {split}")
                    engine = (config, model, drafter, target, session)
                    results = _decode_split(
                        engine, tokenizer, prompts[split], spec, progress, references[split], features[split]
                    )
                    requests = [r.to_dict() for r in results]
                    summary = summarize(requests)
                    # One line per finished cell, also when the bar is off (a log shows progress).
                    progress_done += len(requests)
                    per_token = summary["draft_seconds_per_token"]
                    drafting = "" if per_token is None else f", drafting {per_token * 1e6:.1f} us/token"
                    tqdm.write(
                        f"eval: {item.name} on {split}: AL {summary['mean_acceptance_length']:.3f} over "
                        f"{len(requests)} requests, {summary['seconds']:.0f} s{drafting} "
                        f"({progress_done}/{total} requests done)"
                    )
                    cells[index].append(Cell(item.name, method, domain, split, summary))
                    record = {"drafter": item.name, "method": method, "train_domain": domain, "split": split}
                    cell_records.append({**record, **_setting(spec), "summary": summary, "requests": requests})
                    mismatches += [
                        {"drafter": item.name, "split": split, "id": r.id, "index": r.mismatch_at, **_setting(spec)}
                        for r in results
                        if r.mismatch_at is not None
                    ]
            if not isinstance(loaded.drafter, NgramDrafter):
                loaded.drafter.to("cpu")
    return cells, cell_records, mismatches


def _decode_split(engine: tuple, tokenizer, prompts, spec, progress, references, features) -> list:
    """One drafter (`engine`: config, model, drafter, target, session) on one split at one setting; a multi-turn
    prompt's next turns follow, each rendered with `tokenizer` after its answer, as the release's MT-Bench."""
    config = engine[0]
    results = _decode_turn(*engine, prompts, spec, progress, references, features)
    pending = [p for p in prompts if p.next_turns]
    while pending:
        answers = {r.id: r.output_ids for r in results}
        pending = [follow_up(p, answers[p.id], tokenizer, config.enable_thinking) for p in pending]
        results += _decode_turn(*engine, pending, spec, progress, references, features)
        pending = [p for p in pending if p.next_turns]
    return results


def _decode_turn(config, model, drafter, target, session, prompts, spec, progress, references, features) -> list:
    """One drafter on one turn's prompts at one setting, with the engine the config names (replay, batched, batch 1)."""
    if config.replay:
        return benchmark.run_requests_replayed(
            model, drafter, prompts, spec, config.batch_size, progress, references, features
        )
    if config.batch_size > 1:
        return benchmark.run_requests_batched(
            model, drafter, prompts, spec, config.batch_size, config.verify_lossless, progress, references
        )
    return benchmark.run_requests(target, session, prompts, spec, config.verify_lossless, progress, references)


def _recorded_config(config, eos: tuple[int, ...], first: SpecConfig) -> dict:
    """results.json's config: the evaluate stage's fields, the EOS ids, the first setting and the sweep's values."""
    return {
        **{k: v for k, v in asdict(config).items() if k not in _NOT_RECORDED},
        "target": str(config.target),
        "output": str(config.output),
        "eos_token_ids": list(eos),
        **_setting(first),
        "sweep_temperature": _as_list(config.temperature),
        "sweep_draft_tokens": _as_list(config.draft_tokens),
        **config.extra,
    }


def _drafter_records(drafters: list[tuple], warnings: dict) -> list[dict]:
    """results.json's drafters: each one's name, path, method, training domain, kind and source."""
    return [
        {
            "name": item.name,
            "path": str(item.path),
            "method": method,
            "train_domain": domain,
            "variant": _variant(loaded.drafter),
            "source": loaded.source,
            "trained_target": loaded.run_config.get("target"),
            "target_warning": warnings.get(item.name),
        }
        for item, loaded, domain, method in drafters
    ]


def _variant(drafter) -> str:
    """The drafter's kind as results name it: osprey / eagle3 (its config) or ngram."""
    return "ngram" if isinstance(drafter, NgramDrafter) else drafter.config.variant


def merge_results(parts: list[dict], output: Path) -> dict:
    """One results.json from evaluations of different drafters on the same splits and setting (say, one per
    training seed, each a resumable step): cells and mismatches concatenated, matrices rebuilt."""
    if not parts:
        raise ValueError("merge_results needs at least one results dict.")
    first = parts[0]
    splits = [s["name"] for s in first["splits"]]
    for part in parts[1:]:
        if [s["name"] for s in part["splits"]] != splits or len(part["sweep"]) != 1 or len(first["sweep"]) != 1:
            raise ValueError("merge_results merges single-setting evaluations of the same splits only.")
        if _sweep_key(part) != _sweep_key(first):
            raise ValueError("merge_results: the evaluations used different decoding settings.")
    names = [d["name"] for part in parts for d in part["drafters"]]
    if len(set(names)) != len(names):
        raise ValueError(f"merge_results: drafter names repeat across the evaluations: {names}.")
    records = [c for part in parts for c in part["cells"]]
    cells = [Cell(c["drafter"], c["method"], c["train_domain"], c["split"], c["summary"]) for c in records]
    matrices = build_matrices(cells, splits)
    merged = {
        **first,
        "drafters": [d for part in parts for d in part["drafters"]],
        "cells": records,
        "matrices": matrices,
        "sweep": [{**first["sweep"][0], "matrices": matrices}],
        "lossless": {
            "checked": all(p["lossless"]["checked"] for p in parts),
            "mismatches": [m for p in parts for m in p["lossless"]["mismatches"]],
        },
    }
    write_results(merged, Path(output))
    return merged


def _sweep_key(results: dict) -> dict:
    return {k: v for k, v in results["sweep"][0].items() if k != "matrices"}


def _setting(spec: SpecConfig) -> dict:
    """The sweep coordinates of one run; the seed matters (and is reported) whenever sampling."""
    return {
        "steps": spec.steps,
        "topk": spec.topk,
        "draft_tokens": spec.draft_tokens,
        "temperature": spec.temperature,
        "seed": spec.seed,
        "sampling": "greedy" if spec.temperature == 0 else "lossless rejection sampling",
    }


def sweep_markdown(sweep: list[dict], column: str | None = None) -> str:
    """One row per (setting, method): mean, in-domain and out-of-domain AL (`column`: one more sweep key)."""
    extra = [column] if column else []
    head = [
        "temperature",
        "draft tokens",
        "steps",
        "topk",
        *[c.replace("_", " ") for c in extra],
        "seed",
        "decoding",
        "method",
        "mean AL",
        "ID AL",
        "OOD AL",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for row in sweep:
        for method, m in row["matrices"].items():
            seed = row["seed"] if row["temperature"] != 0 else "-"
            cells = [
                f"{row['temperature']:g}",
                row["draft_tokens"],
                row["steps"],
                row["topk"],
                *[row[c] for c in extra],
                seed,
                row["sampling"],
                method,
                fmt(m["mean"]),
                fmt(m["id_mean"]),
                fmt(m["ood_mean"]),
            ]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def write_results(results: dict, output: Path) -> None:
    """results.json, matrix.md and matrix.png under `output` (each written atomically)."""
    output.mkdir(parents=True, exist_ok=True)
    cfg = results["config"]
    header = (
        f"Target `{cfg['target']}`; steps {cfg['steps']}, topk {cfg['topk']}, draft tokens "
        f"{cfg['draft_tokens']}, temperature {cfg['temperature']}, max new tokens {cfg['max_new_tokens']}; "
        + ", ".join(f"{s['name']}: {s['requests']} prompts" for s in results["splits"])
        + "."
    )
    write_text_atomic(output / "results.json", json.dumps(results, indent=2) + "\n")
    text = matrix_markdown(results["matrices"], header)
    if len(results.get("sweep") or []) > 1:
        column = "batch_size" if "batch_size" in results["sweep"][0] else None
        text += "\n## Sweep (one row per setting and method)\n\n" + sweep_markdown(results["sweep"], column)
    write_text_atomic(output / "matrix.md", text)
    plot_matrices(results["matrices"], output / "matrix.png")
