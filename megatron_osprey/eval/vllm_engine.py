"""Evaluation in the real serving engine: vLLM serves the target alone and with each exported drafter.

The same prompts as the reference engine (the same chat template, rendered and tokenized here and sent to
``/v1/completions`` as token ids), greedy, the same EOS ids and new-token budget. A multi-turn row (MT-Bench's two
turns) is a conversation: its next user turn is rendered after vLLM's own answer (the chat so far, through the
same template) and sent as the conversation's next request; conversations run side by side at each concurrency,
each one's turns in sequence, and every turn is a request of the split on both engines. Per drafter and eval split:

* lossless: the token ids vLLM returns (``return_token_ids``) equal target-only decoding's at the same
  concurrency;
* acceptance length from vLLM's own counters on ``/metrics``: accepted tokens / draft rounds + 1, the deltas
  taken around each drafter x split run (no other request is in flight), and per-position acceptance;
* tokens/s and the speedup over target-only at each concurrency (1, 4, 16 by default).

The reference engine's AL on the same requests goes beside vLLM's; a gap beyond ``AL_TOLERANCE`` fails the
evaluation with one sentence naming the drafter: the guard against a mis-served export (AL near 1.0).

The counters, the comparisons and the table are eval/vllm_metrics.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import secrets
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megatron_osprey.base.engines import (
    CPU_KV_CACHE_BYTES,
    EngineServer,
    EngineUnavailable,
    VllmServeArgs,
    cpu_preload,
    engine_version,
    free_loopback_port,
    vllm_environment,
)
from megatron_osprey.eval.vllm_metrics import (
    SpecCounters,
    agreement_failures,
    lossless_mismatches,
    parse_spec_counters,
    reference_round_al,
    vllm_markdown,
)

VLLM_TAG = "megatron_osprey.eval.vllm/1"
CONCURRENCY = (1, 4, 16)


# Every drafter is served from `export --format vllm`: stock Eagle3LlamaForCausalLM where vLLM's own class computes
# the drafter, this package's plugin elsewhere (export/layouts.py decides), and aux layer ids in vLLM's count. Not the
# SGLang layout: vLLM reads its layer ids one layer too shallow (SGLang adds the one itself), a silent mis-serve.
VLLM_FORMAT = "vllm"


# ---- the server and its client ------------------------------------------------------------------------------


@dataclasses.dataclass
class VllmSettings:
    """How the servers run: the engine's interpreter, compile or eager, the KV cache, the concurrency sweep."""

    python: str
    repo: Path  # on PYTHONPATH of the server, so vLLM imports this checkout's model plugin
    log_dir: Path
    compile: bool = False  # False: --enforce-eager (startup about 4x faster on CPU)
    kv_cache_bytes: int | None = CPU_KV_CACHE_BYTES  # None: vLLM's own share of the GPU's memory
    max_model_len: int = 2048
    tensor_parallel_size: int = 1
    dtype: str = "float32"
    concurrency: tuple[int, ...] = CONCURRENCY
    on_cpu: bool = True
    startup_timeout: float = 900.0
    request_timeout: float = 1800.0


@dataclasses.dataclass
class Client:
    """The OpenAI server of one `vllm serve` process."""

    url: str
    model: str
    api_key: str
    timeout: float

    def _request(self, path: str, body: dict | None = None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            headers={"Authorization": f"Bearer {self.api_key}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            return response.read()

    def complete(self, prompt_ids: list[int], max_tokens: int, stop_ids: list[int]) -> list[int]:
        """Greedy completion of a token-id prompt; returns the generated token ids."""
        body = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stop_token_ids": stop_ids,
            "return_token_ids": True,
        }
        choice = json.loads(self._request("/v1/completions", body))["choices"][0]
        if choice.get("token_ids") is None:
            raise RuntimeError(f"{self.url}: the completion has no token_ids; is the server vLLM 0.32?")
        return [int(t) for t in choice["token_ids"]]

    def counters(self) -> SpecCounters:
        return parse_spec_counters(self._request("/metrics").decode())


@contextlib.contextmanager
def serve(settings: VllmSettings, target: Path, name: str, speculative_config: dict | None = None):
    """A `vllm serve` of `target` (with `speculative_config`) on a free loopback port; yields its Client."""
    port, key = free_loopback_port(), secrets.token_hex(16)
    args = VllmServeArgs(
        model=str(target),
        port=port,
        served_model_name=name,
        dtype=settings.dtype,
        tensor_parallel_size=settings.tensor_parallel_size,
        max_model_len=settings.max_model_len,
        max_num_seqs=max(settings.concurrency),
        kv_cache_memory_bytes=settings.kv_cache_bytes,
        speculative_config=speculative_config,
        enforce_eager=not settings.compile,
    )
    env = vllm_environment(settings.python, key, os.environ, on_cpu=settings.on_cpu, repo=settings.repo)
    url = f"http://127.0.0.1:{port}"
    began = time.monotonic()
    with EngineServer(args.argv(settings.python), url, settings.log_dir / f"{name}.log", env, settings.startup_timeout):
        print(f"vllm: {name} up in {time.monotonic() - began:.0f} s", flush=True)
        yield Client(url, name, key, settings.request_timeout)


def complete_all(
    client: Client, prompts: list, max_tokens: int, stop_ids: list[int], concurrency: int, next_turn=None
) -> tuple:
    """Every conversation, `concurrency` in flight, each one's turns in sequence (a multi-turn row's next turn is
    rendered by next_turn after the answer to the one before): ({request id: token ids}, wall seconds)."""
    from megatron_osprey.eval.prompts import by_turn, converse

    def ask(prompt) -> tuple:
        out = client.complete([int(t) for t in prompt.input_ids], max_tokens, stop_ids)
        return (prompt.id, out), out

    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        conversations = list(pool.map(lambda prompt: converse(prompt, ask, next_turn), prompts))
    return dict(by_turn(conversations)), time.perf_counter() - began


def measure(
    client: Client, prompts: dict[str, list], max_tokens: int, stop_ids: list[int], concurrency, next_turn=None
) -> dict:
    """Each split at each concurrency: {split: {c: {tokens, seconds, in_flight, outputs, counters}}}; the counters
    cover every turn of a multi-turn row, as the reference engine's AL does."""
    first = next(iter(prompts.values()))[0]
    client.complete([int(t) for t in first.input_ids], 4, stop_ids)  # warm-up, outside every measurement
    out: dict = {}
    for split, split_prompts in prompts.items():
        for c in concurrency:
            before = client.counters()
            outputs, seconds = complete_all(client, split_prompts, max_tokens, stop_ids, c, next_turn)
            delta = client.counters() - before
            tokens = sum(len(t) for t in outputs.values())
            out.setdefault(split, {})[c] = {
                "in_flight": min(c, len(split_prompts)),
                "completion_tokens": tokens,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds if seconds > 0 else None,
                "outputs": outputs,
                "counters": delta,
            }
    return out


# ---- the evaluation -------------------------------------------------------------------------------------------


def evaluate_in_vllm(
    config, reference: dict, prompts: dict[str, list], eos: list[int], drafters: list, next_turn
) -> dict:
    """results.json's "vllm" section: target-only, then each drafter, served and measured; the agreement check.

    `reference` is the reference engine's results.json on the same requests; `drafters` are
    (DrafterSpec, LoadedDrafter, method) of servable drafters; `next_turn(prompt, output ids)` renders a multi-turn
    row's next turn (eval/prompts.py's follow_up with the target's tokenizer)."""
    import torch

    output = Path(config.output)
    python = config.vllm_python
    version = engine_version("vllm", python)
    on_cpu = not torch.cuda.is_available()
    longest = max(conversation_positions(p, next_turn, config.max_new_tokens) for ps in prompts.values() for p in ps)
    settings = VllmSettings(
        python=python,
        repo=Path(__file__).resolve().parents[2],
        log_dir=output / "vllm" / "logs",
        compile=config.vllm_compile,
        # a small KV cache on CPU, where vLLM would otherwise reserve a share of the machine's RAM; on a GPU, vLLM's
        kv_cache_bytes=config.vllm_kv_cache_bytes or (CPU_KV_CACHE_BYTES if on_cpu else None),
        tensor_parallel_size=config.vllm_tensor_parallel_size,
        dtype=config.dtype,
        # the longest turn's prompt + new tokens + one verify's draft tokens, rounded up to vLLM's block of 16
        max_model_len=-(-(longest + config.steps + 1) // 16) * 16,
        concurrency=tuple(config.vllm_concurrency),
        on_cpu=on_cpu,
    )
    target = Path(config.target)
    exports = {item.name: export_for_vllm(item.name, loaded, output, target) for item, loaded, _ in drafters}
    with serve(settings, target, "target") as client:
        target_only = measure(client, prompts, config.max_new_tokens, eos, settings.concurrency, next_turn)
    records = {}
    for item, _, method in drafters:
        fmt, export_dir = exports[item.name]
        spec = {"method": "eagle3", "model": str(export_dir), "num_speculative_tokens": config.steps}
        with serve(settings, target, item.name, spec) as client:
            served = measure(client, prompts, config.max_new_tokens, eos, settings.concurrency, next_turn)
        records[item.name] = _drafter_record(item.name, method, fmt, export_dir, spec, served, target_only, reference)
    failures = agreement_failures(records, config.al_tolerance)
    mismatches = [
        {"drafter": name, "split": split, **m}
        for name, r in records.items()
        for split, s in r["splits"].items()
        for m in s["lossless_mismatches"]
    ]
    preload = cpu_preload(python) if on_cpu else None
    return {
        "format": VLLM_TAG,
        "engine": {
            "name": "vllm",
            "version": version,
            "python": python,
            "device": "cpu" if on_cpu else "cuda",
            "enforce_eager": not settings.compile,
            "kv_cache_memory_bytes": settings.kv_cache_bytes,
            "max_model_len": settings.max_model_len,
            "ld_preload": Path(preload).name if preload else None,
            "concurrency": list(settings.concurrency),
            "num_speculative_tokens": config.steps,
            "logs": str(settings.log_dir),
        },
        "target_only": {split: {str(c): _speed(run) for c, run in runs.items()} for split, runs in target_only.items()},
        "drafters": records,
        "agreement": {"tolerance": config.al_tolerance, "failures": failures},
        "lossless": {"checked": True, "mismatches": mismatches},
    }


# Tokens a decoded answer may gain when the next turn re-tokenizes it (merges across its ends, a character the budget
# cut in half): the room left per earlier answer beyond its new-token budget.
ANSWER_RETOKENIZE_SLACK = 8


def conversation_positions(prompt, next_turn, max_new_tokens: int) -> int:
    """The positions a conversation's longest request can take: its last turn rendered with empty answers, each
    earlier answer at its budget (and the slack), plus the last answer's budget."""
    answers = 0
    while prompt.next_turns:
        prompt = next_turn(prompt, [])
        answers += 1
    return len(prompt.input_ids) + answers * (max_new_tokens + ANSWER_RETOKENIZE_SLACK) + max_new_tokens


def export_for_vllm(name: str, loaded, output: Path, target: Path) -> tuple[str, Path]:
    """The drafter written in the format vLLM serves it from, under OUTPUT/vllm/exports/NAME (this run's own
    directory, replaced); every drafter is exported before any server starts, so a refusal comes first."""
    import shutil

    from megatron_osprey.export.formats import export_drafter

    fmt = VLLM_FORMAT
    export_dir = output / "vllm" / "exports" / name
    if export_dir.exists():
        shutil.rmtree(export_dir)
    # Checked against the target this evaluation serves, not the one the drafter's run_config names.
    export_drafter(loaded.drafter, fmt, export_dir, {**loaded.run_config, "target": str(target)}, tokenizer_dir=target)
    return fmt, export_dir


def _speed(run: dict) -> dict:
    return {k: run[k] for k in ("in_flight", "completion_tokens", "seconds", "tokens_per_s")}


def _drafter_record(name, method, fmt, export_dir, spec, served, target_only, reference) -> dict:
    """One drafter's figures per split, and pooled over the splits at concurrency 1 beside the reference's."""
    cells = {(c["drafter"], c["split"]): c for c in reference["cells"]}
    splits, pooled, pooled_reference = {}, SpecCounters(), []
    for split, runs in served.items():
        first = runs[min(runs)]  # the lowest concurrency: batch 1, the paper's serving setting
        counters = first["counters"]
        pooled = pooled + counters
        requests = cells[(name, split)]["requests"]
        pooled_reference += requests
        splits[split] = {
            "acceptance_length": counters.acceptance_length(),
            "reference_acceptance_length": reference_round_al(requests),
            "reference_mean_acceptance_length": cells[(name, split)]["summary"]["mean_acceptance_length"],
            "drafts": counters.drafts,
            "draft_tokens": counters.draft_tokens,
            "accepted_tokens": counters.accepted,
            "position_acceptance": counters.position_acceptance(),
            "lossless_mismatches": [
                {**m, "concurrency": c}
                for c, run in runs.items()
                for m in lossless_mismatches(run["outputs"], target_only[split][c]["outputs"])
            ],
            "concurrency": {
                str(c): {
                    **_speed(run),
                    "acceptance_length": run["counters"].acceptance_length(),
                    "target_only_tokens_per_s": target_only[split][c]["tokens_per_s"],
                    "speedup": _ratio(run["tokens_per_s"], target_only[split][c]["tokens_per_s"]),
                }
                for c, run in runs.items()
            },
        }
    return {
        "method": method,
        "export": str(export_dir),
        "export_format": fmt,
        "speculative_config": spec,
        "acceptance_length": pooled.acceptance_length(),
        "reference_acceptance_length": reference_round_al(pooled_reference),
        "position_acceptance": pooled.position_acceptance(),
        "speedup": _pooled_speedup(served, target_only),
        "splits": splits,
    }


def _ratio(a, b):
    return a / b if a and b else None


def _pooled_speedup(served: dict, target_only: dict) -> dict:
    """Per concurrency: tokens/s over every split (total tokens / total seconds), and over target-only's."""
    out = {}
    for c in next(iter(served.values())):
        ours = [served[s][c] for s in served]
        theirs = [target_only[s][c] for s in served]
        speed = sum(r["completion_tokens"] for r in ours) / sum(r["seconds"] for r in ours)
        base = sum(r["completion_tokens"] for r in theirs) / sum(r["seconds"] for r in theirs)
        out[str(c)] = {"tokens_per_s": speed, "target_only_tokens_per_s": base, "speedup": speed / base}
    return out


def engine_or_reason(explicit: str | None, environ, repo: Path | None) -> tuple[str | None, str | None]:
    """(interpreter, None) when the engine is installed at the pinned release, else (None, the sentence why)."""
    from megatron_osprey.base.engines import engine_python

    try:
        python = engine_python("vllm", explicit, environ, repo)
        engine_version("vllm", python)
    except EngineUnavailable as error:
        return None, str(error)
    return python, None


def check_engine_request(config) -> None:
    """--engine vllm measures greedy chains of one shape; refuse anything else before any loading."""
    if [float(t) for t in config.temperature] != [0.0]:
        raise ValueError("--engine vllm checks lossless greedy decoding: pass --temperature 0 alone.")
    if config.topk != 1:
        raise ValueError(f"--engine vllm serves EAGLE-3 chains (topk 1); got --topk {config.topk}.")
    if config.draft_tokens not in (None, [config.steps + 1]):
        raise ValueError(f"--engine vllm drafts --steps tokens per round; drop --draft-tokens {config.draft_tokens}.")
    if config.replay:
        raise ValueError("--engine vllm decodes live; drop --replay.")
    if not config.vllm_python:
        raise ValueError("--engine vllm needs --vllm-python (or VLLM_PYTHON).")
    if config.vllm_tensor_parallel_size < 1:
        raise ValueError(f"--vllm-tensor-parallel-size must be 1 or more, got {config.vllm_tensor_parallel_size}.")
    if config.vllm_kv_cache_bytes is not None and config.vllm_kv_cache_bytes < 1:
        raise ValueError(f"--vllm-kv-cache-bytes must be positive, got {config.vllm_kv_cache_bytes}.")
    if config.dtype == "float64":
        raise ValueError("--engine vllm serves float32, bfloat16 or float16; got --dtype float64.")
    bad = [c for c in config.vllm_concurrency if c < 1]
    if bad or not config.vllm_concurrency:
        raise ValueError(f"--vllm-concurrency takes positive integers, got {config.vllm_concurrency}.")


def check_reference(reference: dict, path, config, splits: list[str], prompts: dict, names: list[str]) -> None:
    """The reference results are of the same requests: splits, request ids and prompt lengths, steps and budget."""
    from megatron_osprey.eval.prompts import turn_ids

    cfg = reference["config"]
    for key, ours in (("steps", config.steps), ("max_new_tokens", config.max_new_tokens), ("temperature", 0.0)):
        if cfg.get(key) != ours:
            raise ValueError(
                f"--reference-results {path} was evaluated with {key} {cfg.get(key)}, this run with {ours}."
            )
    if [s["name"] for s in reference["splits"]] != splits:
        raise ValueError(
            f"--reference-results {path} has splits {[s['name'] for s in reference['splits']]}, not {splits}."
        )
    cells = {(c["drafter"], c["split"]): c for c in reference["cells"]}
    for name in names:
        for split in splits:
            cell = cells.get((name, split))
            if cell is None:
                raise ValueError(f"--reference-results {path} has no cell for drafter {name} on {split}.")
            # The first turns' prompts are the same to the token; a later turn's follows its engine's own answer.
            theirs = [(r["id"], r["prompt_tokens"]) for r in cell["requests"]]
            ours = [(p.id, len(p.input_ids)) for p in prompts[split]]
            if [i for i, _ in theirs] != turn_ids(prompts[split]) or theirs[: len(ours)] != ours:
                raise ValueError(
                    f"--reference-results {path}: drafter {name} on {split} was measured on other requests "
                    "(ids or prompt lengths differ); evaluate both engines with the same --data, --limit and "
                    "--prompt-messages."
                )


def run_vllm_eval(config) -> dict:
    """--engine vllm: the reference engine's results (run here, or --reference-results), then vLLM on the same
    requests; writes OUTPUT/results.json (with its "vllm" section) and OUTPUT/vllm.md."""
    from megatron_osprey.base.atomic_io import write_text_atomic
    from megatron_osprey.eval.loading import load_drafter, target_facts
    from megatron_osprey.eval.prompts import follow_up
    from megatron_osprey.eval.run import (
        _eos_ids,
        _load_split_prompts,
        _variant,
        run_eval,
        split_names,
        sweep_settings,
        write_results,
    )
    from megatron_osprey.export.layouts import vllm_refusal
    from megatron_osprey.speculative import SpecConfig

    check_engine_request(config)
    engine_version("vllm", config.vllm_python)  # a missing or broken engine: one sentence, before any work
    target_file = Path(config.target) / "config.json"
    target_config = json.loads(target_file.read_text()) if target_file.is_file() else None
    drafters = []
    for item in config.drafters:
        loaded = load_drafter(item.path, verify=not config.skip_checksum)
        if not hasattr(loaded.drafter, "config"):
            raise ValueError(f"--drafter {item.name}: an n-gram drafter has no vLLM EAGLE-3 export.")
        refusal = vllm_refusal(loaded.drafter.config, target_config)  # before the reference engine runs
        if refusal:
            raise ValueError(f"--drafter {item.name} cannot be served in vLLM: {refusal}")
        drafters.append((item, loaded, item.method or _variant(loaded.drafter)))
    splits = split_names(config.data)
    if config.reference_results:
        path = Path(config.reference_results)
        if not path.is_file():
            raise FileNotFoundError(f"--reference-results {path}: no such file.")
        reference = json.loads(path.read_text())
        if (Path(config.output) / "results.json").exists() and not config.overwrite:
            raise FileExistsError(f"--output {config.output}: results.json already exists; pass --overwrite.")
    else:
        reference = run_eval(config)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(config.target))
    target_config, generation_config = target_facts(config, None)
    eos = list(_eos_ids(config.target, generation_config, tokenizer))
    specs = [SpecConfig(**kw, eos_token_ids=tuple(eos)) for kw in sweep_settings(config)]
    prompts, _ = _load_split_prompts(config, splits, tokenizer, target_config, specs)
    check_reference(reference, config.reference_results, config, splits, prompts, [d[0].name for d in drafters])
    # A multi-turn row's next turn, rendered after vLLM's answer as the reference engine renders it after its own.
    next_turn = functools.partial(follow_up, tokenizer=tokenizer, enable_thinking=config.enable_thinking)
    section = evaluate_in_vllm(config, reference, prompts, eos, drafters, next_turn)
    # Where the reference engine's side came from: this run, or an earlier evaluation of the same requests.
    section["reference_results"] = str(config.reference_results) if config.reference_results else None
    results = {**reference, "vllm": section}
    output = Path(config.output)
    write_results(results, output)
    write_text_atomic(output / "vllm.md", vllm_markdown(section))
    return results
