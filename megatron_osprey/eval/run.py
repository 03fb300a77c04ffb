"""The AL benchmark: every drafter on every eval split against one HF target; writes results and the matrix."""

from __future__ import annotations

import contextlib

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from megatron_osprey.convert.safetensors_io import write_text_atomic
from megatron_osprey.eval import benchmark
from megatron_osprey.eval.loading import load_drafter
from megatron_osprey.eval.matrix import Cell, build_matrices, matrix_markdown, plot_matrices, summarize
from megatron_osprey.eval.prompts import load_prompts
from megatron_osprey.speculative import HFTargetModel, SpecConfig

RESULTS_TAG = "megatron_osprey.eval/1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class DrafterSpec:
    """A drafter to evaluate: its name, directory, training domain and method (None: from its run_config)."""

    name: str
    path: Path
    train_domain: str | None = None
    method: str | None = None


@dataclass
class EvalConfig:
    """python -m megatron_osprey.eval settings (defaults: the paper's serving config)."""

    target: Path
    drafters: list[DrafterSpec]
    data: list[Path]
    output: Path
    steps: int = 5
    topk: int = 1
    draft_tokens: int | None = 6
    temperature: float = 0.0
    max_new_tokens: int = 256
    limit: int | None = None
    verify_lossless: bool = False
    dtype: str = "float32"
    device: str = "auto"
    enable_thinking: bool | None = None
    seed: int = 0
    progress: bool = True
    target_backend: str = "hf"  # or "megatron": the Megatron-Core model (exact recompute, no KV cache)
    truncate_prompts: bool = False  # keep a too-long prompt's last tokens instead of refusing it
    overwrite: bool = False  # replace an existing OUTPUT/results.json
    extra: dict = field(default_factory=dict)


def split_names(paths: list[Path]) -> list[str]:
    """Each split is named by its file stem (``code.jsonl`` -> ``code``); names must be distinct."""
    names = [Path(p).name.split(".")[0] for p in paths]
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


def _load_target(config: EvalConfig):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = Path(config.target)
    if not (target / "config.json").is_file():
        raise FileNotFoundError(f"--target {target}: no config.json there (a HF model directory is expected).")
    if config.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {config.dtype!r}.")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    if config.target_backend == "megatron":
        return None, tokenizer, "cpu"
    if config.target_backend != "hf":
        raise ValueError(f"--target-backend must be hf or megatron, got {config.target_backend!r}.")
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=DTYPES[config.dtype]).to(device).eval()
    return model, tokenizer, device


def _target_facts(config: EvalConfig, model) -> tuple[object, object]:
    """(model config, generation config) without loading weights when the HF model is not used."""
    from transformers import AutoConfig, GenerationConfig

    if model is not None:
        return model.config, model.generation_config
    try:
        generation = GenerationConfig.from_pretrained(str(config.target))
    except OSError:
        generation = None
    return AutoConfig.from_pretrained(str(config.target)), generation


def fit_prompts(prompts: list, path: Path, config: EvalConfig, max_positions: int | None,
                draft_tokens: int) -> tuple[list, int]:
    """Refuse (or, with --truncate-prompts, left-truncate) prompts whose decode would pass the target's positions.

    A prompt plus --max-new-tokens plus one verify step's draft tokens must fit in
    max_position_embeddings; past it a RoPE model decodes without an error but
    out of its trained range, so the AL would be measured on garbage.
    """
    if not max_positions:
        return prompts, 0
    room = max_positions - config.max_new_tokens - draft_tokens
    out, cut = [], 0
    for prompt in prompts:
        n = len(prompt.input_ids)
        if n <= room:
            out.append(prompt)
            continue
        if not config.truncate_prompts or room < 1:
            raise ValueError(
                f"--data {path}: prompt {prompt.id!r} has {n} tokens; with --max-new-tokens {config.max_new_tokens} "
                f"and {draft_tokens} draft tokens it needs {n + config.max_new_tokens + draft_tokens} positions, more "
                f"than --target {config.target}'s max_position_embeddings {max_positions}. Pass --truncate-prompts "
                f"to keep its last {max(room, 0)} tokens, or lower --max-new-tokens.")
        out.append(type(prompt)(prompt.id, prompt.input_ids[n - room:]))
        cut += 1
    return out, cut


def check_drafter_fits_target(path: Path, drafter_config, target: Path, target_config) -> None:
    """The drafter reads the target's hidden states: sizes and tapped layers must match, naming both models."""
    vocab = target_config.vocab_size
    if drafter_config.vocab_size != vocab:
        raise ValueError(f"--drafter {path}: its vocabulary ({drafter_config.vocab_size}) is not the target's "
                         f"({vocab}); was it adapted to --target {target}?")
    hidden = getattr(target_config, "hidden_size", None)
    if hidden is not None and drafter_config.target_hidden_size != hidden:
        raise ValueError(f"--drafter {path} was trained on hidden states of size {drafter_config.target_hidden_size}, "
                         f"but --target {target} has hidden_size {hidden}; it belongs to another target.")
    layers = getattr(target_config, "num_hidden_layers", None)
    if layers is not None and max(drafter_config.aux_layer_ids) >= layers:
        raise ValueError(f"--drafter {path} taps target layers {list(drafter_config.aux_layer_ids)}, but --target "
                         f"{target} has {layers} layers; it belongs to another target.")


@contextlib.contextmanager
def _target_factory(config: EvalConfig, model):
    """Yields make(aux_layer_ids) -> TargetModel, for the HF model or a Megatron-Core stage."""
    if model is not None:
        yield lambda aux: HFTargetModel(model, aux)
        return
    from megatron_osprey.models.targets.target import load_target
    from megatron_osprey.parallel import ParallelConfig, parallel_context
    from megatron_osprey.speculative.megatron_target import MegatronTargetModel

    with parallel_context(ParallelConfig()) as state:
        stage = load_target(config.target, state.config, state.device, with_lm_head=True, transformer_impl="local")
        yield lambda aux: MegatronTargetModel(stage.model, aux, stage.arch.vocab_size)


def run_eval(config: EvalConfig) -> dict:
    """Run the benchmark and write OUTPUT/results.json, matrix.md and matrix.png; returns the results."""
    if config.verify_lossless and config.temperature != 0:
        raise ValueError("--verify-lossless compares greedy outputs token by token; it needs --temperature 0.")
    spec_kwargs = dict(steps=config.steps, topk=config.topk, draft_tokens=config.draft_tokens,
                       temperature=config.temperature, max_new_tokens=config.max_new_tokens, seed=config.seed)
    SpecConfig(**spec_kwargs)  # validate the draft shape before any loading
    splits = split_names(config.data)
    names = [d.name for d in config.drafters]
    if len(set(names)) != len(names):
        raise ValueError(f"--drafter names must be distinct, got {names}.")
    results_path = Path(config.output) / "results.json"
    if results_path.exists() and not config.overwrite:
        raise FileExistsError(f"--output {config.output}: {results_path} already exists; pass --overwrite to "
                              f"replace it, or choose another --output.")
    model, tokenizer, device = _load_target(config)
    target_config, generation_config = _target_facts(config, model)
    spec = SpecConfig(**spec_kwargs, eos_token_ids=_eos_ids(config.target, generation_config, tokenizer))
    prompts, truncated = {}, {}
    for name, path in zip(splits, config.data):
        loaded_prompts = load_prompts(path, tokenizer, config.limit, config.enable_thinking)
        prompts[name], truncated[name] = fit_prompts(
            loaded_prompts, path, config, getattr(target_config, "max_position_embeddings", None), spec.draft_tokens)
    drafters = []
    for item in config.drafters:
        loaded = load_drafter(item.path)
        cfg = loaded.drafter.config
        check_drafter_fits_target(item.path, cfg, config.target, target_config)
        drafters.append((item, loaded, item.train_domain or _domain_from_run_config(loaded.run_config),
                         item.method or cfg.variant))

    from tqdm import tqdm

    total = len(drafters) * sum(len(p) for p in prompts.values())
    cells, cell_records, mismatches = [], [], []
    references = {split: {} for split in splits}  # target-only decodes, shared by the drafters
    with tqdm(total=total, desc="eval", unit="req", disable=not config.progress) as progress, \
            _target_factory(config, model) as make_target:
        for item, loaded, domain, method in drafters:
            drafter = loaded.drafter.to(device=device, dtype=DTYPES[config.dtype])
            target = make_target(list(drafter.config.aux_layer_ids))
            session = benchmark.make_session(drafter)
            for split in splits:
                progress.set_description(f"{item.name} on {split}")
                results = benchmark.run_requests(target, session, prompts[split], spec, config.verify_lossless, progress,
                                                 references[split])
                requests = [r.to_dict() for r in results]
                summary = summarize(requests)
                cells.append(Cell(item.name, method, domain, split, summary))
                cell_records.append({"drafter": item.name, "method": method, "train_domain": domain,
                                     "split": split, "summary": summary, "requests": requests})
                mismatches += [{"drafter": item.name, "split": split, "id": r.id, "index": r.mismatch_at}
                               for r in results if r.mismatch_at is not None]
            loaded.drafter.to("cpu")
    matrices = build_matrices(cells, splits)
    results = {
        "format": RESULTS_TAG,
        "config": {**{k: v for k, v in asdict(config).items() if k not in ("drafters", "data", "extra")},
                   "target": str(config.target), "output": str(config.output), "eos_token_ids": list(spec.eos_token_ids),
                   "draft_tokens": spec.draft_tokens, **config.extra},
        "drafters": [{"name": item.name, "path": str(item.path), "method": method, "train_domain": domain,
                      "variant": loaded.drafter.config.variant, "source": loaded.source}
                     for item, loaded, domain, method in drafters],
        "splits": [{"name": s, "path": str(p), "requests": len(prompts[s]), "truncated_prompts": truncated[s]}
                   for s, p in zip(splits, config.data)],
        "cells": cell_records,
        "matrices": matrices,
        "lossless": {"checked": config.verify_lossless, "mismatches": mismatches},
    }
    write_results(results, Path(config.output))
    return results


def write_results(results: dict, output: Path) -> None:
    """results.json, matrix.md and matrix.png under `output` (each written atomically)."""
    output.mkdir(parents=True, exist_ok=True)
    cfg = results["config"]
    header = (f"Target `{cfg['target']}`; steps {cfg['steps']}, topk {cfg['topk']}, draft tokens "
              f"{cfg['draft_tokens']}, temperature {cfg['temperature']}, max new tokens {cfg['max_new_tokens']}; "
              + ", ".join(f"{s['name']}: {s['requests']} prompts" for s in results["splits"]) + ".")
    write_text_atomic(output / "results.json", json.dumps(results, indent=2) + "\n")
    write_text_atomic(output / "matrix.md", matrix_markdown(results["matrices"], header))
    plot_matrices(results["matrices"], output / "matrix.png")
