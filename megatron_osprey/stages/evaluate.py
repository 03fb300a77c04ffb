"""Evaluate: acceptance length of drafters x eval splits against a HF target.

    python -m megatron_osprey evaluate --target TARGET --drafter [NAME=]PATH [--drafter ...] \\
        --data SPLIT.jsonl [--data ...] --output DIR [--steps 5 --topk 1 --draft-tokens 6 [8 ...] \\
        --temperature 0 [1 ...] --max-new-tokens 4096 --prompt-messages first_user --limit N --verify-lossless] \\
        [--names A B ...] [--train-domain [NAME=]DOMAIN ...] [--method [NAME=]METHOD ...]

Each split is named by its file stem; each drafter by NAME=, --names, or its directory. A drafter's training
domain comes from --train-domain or its run_config.yaml (train_domain); its method (matrix group) from
--method or its variant (osprey / eagle3). Writes DIR/results.json, DIR/matrix.md and DIR/matrix.png (an
existing results.json needs --overwrite). Exit status: 0 ok, 1 --verify-lossless found a mismatch, 2 bad input.

Defaults are the paper's benchmark protocol: the first user message of each conversation, up to 4096 new
tokens, steps 5 / topk 1 / 6 draft tokens, greedy. `--temperature` and `--draft-tokens` take lists and every
combination is one sweep row (with topk 1, d draft tokens means d - 1 steps); sampling rows use lossless
rejection sampling and report their --seed. The benchmark is eval/run.py.

--engine vllm [--vllm-python PY] [--reference-results RESULTS.json] [--vllm-concurrency 1 4 16] [--vllm-compile]:
the reference engine's results (run here, or read from an earlier evaluation of the same requests), then vLLM
(VLLM_PYTHON, else the repository's .venv-vllm) serves the target alone and with each drafter, exported in the
format vLLM loads for its kind, on the same token ids: lossless check per concurrency, AL and per-position
acceptance from its /metrics counters beside the reference engine's AL, tokens/s and speedup over target-only.
Writes results.json's "vllm" section and DIR/vllm.md; exit 1 also when a drafter's two ALs differ by more than
the tolerance (a mis-served export) or vLLM's tokens differ from target-only decoding.

Trust: a Megatron drafter checkpoint is torch distributed-checkpoint data, which torch unpickles; its .metadata
is checked against an allow-list first, but evaluate only checkpoints you trust. Exported drafters (safetensors
+ JSON, the export stage) hold no code.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from megatron_osprey.config.flags import STORE_TRUE, Flag, boolean, skip_checksum_flag
from megatron_osprey.eval.config import DTYPE_NAMES, EVAL_ENGINES, DrafterSpec
from megatron_osprey.models.target.config import TARGET_BACKENDS
from megatron_osprey.stages.cli import Invocation, check_inputs, exit_code, parse_config

PROMPT_MESSAGES = ("first_user", "before_assistant")


@dataclasses.dataclass
class EvaluateConfig:
    """Evaluation settings (defaults: the paper's serving config and benchmark protocol)."""

    target: str | None = None
    drafters: list[DrafterSpec] = dataclasses.field(default_factory=list)
    # Applied to `drafters` by position or NAME=VALUE (the flags --names, --train-domain, --method).
    names: list[str] | None = None
    train_domain: list[str] = dataclasses.field(default_factory=list)
    method: list[str] = dataclasses.field(default_factory=list)
    data: list[str] = dataclasses.field(default_factory=list)
    output: str | None = None
    steps: int = 5
    topk: int = 1
    draft_tokens: list[int] | None = None  # None: steps + 1
    temperature: list[float] = dataclasses.field(default_factory=lambda: [0.0])
    max_new_tokens: int = 4096  # the paper's benchmark; CPU runs pass less
    prompt_messages: str = "first_user"  # the paper's: the first user message only
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
    skip_checksum: bool = False  # load Megatron --drafter checkpoints without checking them against checksums.json
    batch_size: int = 1  # > 1: the batched greedy-chain engine (same tokens and AL, several requests per forward)
    replay: bool = False  # AL by replaying the target's greedy output: one target forward per prompt for all drafters
    # The real serving engine (--engine vllm): the reference engine runs (or --reference-results is read), then
    # vLLM serves the target alone and with each drafter on the same requests.
    engine: str = "reference"
    vllm_python: str | None = None  # None: VLLM_PYTHON, else the repository's .venv-vllm (read by run())
    vllm_compile: bool = False  # False: --enforce-eager (on CPU startup takes about 50 s instead of 225 s)
    vllm_kv_cache_bytes: int | None = None  # None: 1 GiB on CPU, vLLM's own share of the memory on a GPU
    vllm_tensor_parallel_size: int = 1
    vllm_concurrency: list[int] = dataclasses.field(default_factory=lambda: [1, 4, 16])
    reference_results: str | None = None  # the reference engine's results.json on the same requests
    al_tolerance: float | None = None  # None: eval/vllm_metrics.AL_TOLERANCE, set from the measured spread
    extra: dict = dataclasses.field(default_factory=dict)

    def resolved(self) -> EvaluateConfig:
        """The config with every drafter named, and its training domain and method attached; checked."""
        for flag, value in (("--target", self.target), ("--output", self.output)):
            if not value:
                raise ValueError(f"{flag} is required.")
        if not self.drafters or not self.data:
            raise ValueError("pass at least one --drafter and one --data split.")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}.")
        names = [d.name for d in self.drafters]
        if self.names is not None:
            if len(self.names) != len(names):
                raise ValueError(f"--names has {len(self.names)} names for {len(names)} --drafter entries.")
            names = list(self.names)
        domains = _keyed(self.train_domain, names, "--train-domain")
        methods = _keyed(self.method, names, "--method")
        drafters = [
            DrafterSpec(n, Path(d.path), domains.get(n, d.train_domain), methods.get(n, d.method))
            for n, d in zip(names, self.drafters)
        ]
        return dataclasses.replace(self, drafters=drafters, names=None, train_domain=[], method=[])


def drafter_spec(text: str) -> DrafterSpec:
    """--drafter [NAME=]PATH; without NAME the run directory names the drafter (OUT/hf, OUT/megatron: OUT)."""
    name, sep, path = text.partition("=")
    path = Path(path if sep else text)
    default = path.parent.name if path.name in ("hf", "megatron") else path.name
    return DrafterSpec(name if sep else default, path)


def _keyed(values: list[str], names: list[str], flag: str) -> dict[str, str]:
    """NAME=VALUE items by name, bare items by position."""
    out, bare = {}, []
    for value in values:
        key, sep, rest = value.partition("=")
        if sep and key in names:
            out[key] = rest
        elif sep:
            raise ValueError(f"{flag} {value}: {key!r} is not a drafter name (names: {names}).")
        else:
            bare.append(value)
    if bare and len(bare) != len(names):
        raise ValueError(f"{flag} given {len(bare)} bare values for {len(names)} drafters; use NAME=VALUE.")
    out.update({n: v for n, v in zip(names, bare) if n not in out})
    return out


FLAGS = {
    "what to evaluate": [
        Flag("--target", "target", {"help": "HF model directory of the target"}),
        Flag("--drafter", "drafters", {"action": "append", "type": drafter_spec, "help": "[NAME=]PATH, repeatable"}),
        Flag("--data", "data", {"action": "append", "help": "conversations JSONL, repeatable"}),
        Flag("--output", "output", {}),
        Flag("--names", "names", {"nargs": "+", "help": "drafter names, in --drafter order"}),
        Flag("--train-domain", "train_domain", {"action": "extend", "nargs": "+", "help": "[NAME=]DOMAIN, in order"}),
        Flag("--method", "method", {"action": "extend", "nargs": "+", "help": "[NAME=]METHOD, in --drafter order"}),
        Flag("--overwrite", "overwrite", {**STORE_TRUE, "help": "replace an existing OUTPUT/results.json"}),
        skip_checksum_flag("each Megatron --drafter checkpoint"),
    ],
    "decoding": [
        Flag("--steps", "steps", {"type": int}),
        Flag("--topk", "topk", {"type": int}),
        Flag(
            "--draft-tokens",
            "draft_tokens",
            {"type": int, "nargs": "+", "help": "one or more; default steps + 1; with topk 1 each sets steps"},
        ),
        Flag("--temperature", "temperature", {"type": float, "nargs": "+", "help": "one or more (a sweep)"}),
        Flag("--max-new-tokens", "max_new_tokens", {"type": int, "help": "the paper's benchmark: 4096"}),
        Flag(
            "--prompt-messages",
            "prompt_messages",
            {"choices": list(PROMPT_MESSAGES), "help": "the first user message (the paper) or all before the reply"},
        ),
        Flag("--limit", "limit", {"type": int, "help": "only the first N prompts of each split"}),
        Flag("--verify-lossless", "verify_lossless", {**STORE_TRUE, "help": "also decode with the target alone"}),
        Flag("--dtype", "dtype", {"choices": sorted(DTYPE_NAMES)}),
        Flag("--device", "device", {}),
        Flag("--enable-thinking", "enable_thinking", {"type": boolean, "metavar": "true|false"}),
        Flag("--seed", "seed", {"type": int}),
        Flag("--no-progress", "progress", {"action": "store_false"}),
        Flag(
            "--target-backend",
            "target_backend",
            {"choices": list(TARGET_BACKENDS), "help": "HF model (default) or Megatron-Core (exact recompute)"},
        ),
        Flag(
            "--truncate-prompts",
            "truncate_prompts",
            {**STORE_TRUE, "help": "keep the last tokens of a prompt too long for the target (default: refuse)"},
        ),
        Flag(
            "--batch-size",
            "batch_size",
            {
                "type": int,
                "help": "requests decoded together (default 1: the reference engine); above 1, greedy chains "
                "(--topk 1, --temperature 0) on the HF target share each forward",
            },
        ),
        Flag(
            "--engine",
            "engine",
            {
                "choices": list(EVAL_ENGINES),
                "help": "reference: this project's engine; vllm: also serve the target and each drafter in vLLM "
                "(lossless check, AL from its counters beside the reference engine's, tokens/s and speedup)",
            },
        ),
        Flag("--vllm-python", "vllm_python", {"help": "the vLLM environment's python (default: VLLM_PYTHON)"}),
        Flag(
            "--vllm-compile",
            "vllm_compile",
            {**STORE_TRUE, "help": "let vLLM compile the model (default --enforce-eager: 4x faster startup on CPU)"},
        ),
        Flag(
            "--vllm-kv-cache-bytes",
            "vllm_kv_cache_bytes",
            {"type": int, "help": "vLLM's KV cache (default: 1 GiB on CPU, vLLM's share of the memory on a GPU)"},
        ),
        Flag(
            "--vllm-tensor-parallel-size",
            "vllm_tensor_parallel_size",
            {"type": int, "help": "GPUs each vLLM server shards the target over (default 1)"},
        ),
        Flag(
            "--vllm-concurrency",
            "vllm_concurrency",
            {"type": int, "nargs": "+", "help": "requests in flight for tokens/s and speedup (default 1 4 16)"},
        ),
        Flag(
            "--reference-results",
            "reference_results",
            {"help": "with --engine vllm: the reference engine's results.json on the same requests (else it runs)"},
        ),
        Flag(
            "--al-tolerance",
            "al_tolerance",
            {
                "type": float,
                "help": "largest |AL vLLM - AL reference| per drafter (default: set from the measured spread)",
            },
        ),
        Flag(
            "--replay",
            "replay",
            {
                **STORE_TRUE,
                "help": "measure AL by replaying the target's greedy output (greedy chains; one target forward "
                "per prompt for every drafter; the same AL as live decoding up to floating-point order; no speed)",
            },
        ),
    ],
}


def run(config: EvaluateConfig, invocation: Invocation = Invocation("evaluate")) -> dict:
    """Decode every prompt of every split with every drafter; write and return results.json's content."""
    from megatron_osprey.base.outputs import check_output_writable
    from megatron_osprey.eval.run import run_eval

    config = config.resolved()
    if config.engine not in EVAL_ENGINES:
        raise ValueError(f"--engine must be one of {EVAL_ENGINES}, got {config.engine!r}.")
    if config.engine == "vllm":
        return _run_vllm(config, invocation)
    inputs = check_inputs({f"drafter:{d.name}": d.path for d in config.drafters})
    inputs |= check_inputs({f"split:{Path(p).name.split('.')[0]}": p for p in config.data})
    check_output_writable(config.output)  # before the run, which may take hours, not at its end
    results = run_eval(config)
    output = Path(config.output)
    invocation.record(output, config, inputs, {"results": output / "results.json"})
    return results


def _run_vllm(config: EvaluateConfig, invocation: Invocation) -> dict:
    """--engine vllm: the engine's interpreter from the flag, VLLM_PYTHON or the repository's .venv-vllm."""
    import os

    from megatron_osprey.base.engines import engine_python
    from megatron_osprey.base.outputs import check_output_writable
    from megatron_osprey.eval.vllm_engine import run_vllm_eval
    from megatron_osprey.eval.vllm_metrics import AL_TOLERANCE

    repo = Path(__file__).resolve().parents[2]
    python = engine_python("vllm", config.vllm_python, os.environ, repo)
    tolerance = AL_TOLERANCE if config.al_tolerance is None else config.al_tolerance
    config = dataclasses.replace(config, vllm_python=python, al_tolerance=tolerance)
    inputs = check_inputs({f"drafter:{d.name}": d.path for d in config.drafters})
    inputs |= check_inputs({f"split:{Path(p).name.split('.')[0]}": p for p in config.data})
    if config.reference_results:
        inputs |= check_inputs({"reference_results": config.reference_results})
    check_output_writable(config.output)
    results = run_vllm_eval(config)
    output = Path(config.output)
    invocation.record(output, config, inputs, {"results": output / "results.json", "vllm": output / "vllm.md"})
    return results


def main(argv: list[str] | None = None, recipes=None) -> int:
    """Parse the flags, evaluate, print each matrix's means; 0 ok, 1 a lossless mismatch, 2 bad input."""
    config, invocation = parse_config(argv, "evaluate", EvaluateConfig, FLAGS, __doc__, recipes)

    def evaluate_and_report() -> int:
        results = run(config, invocation)
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        for row in results["sweep"]:
            setting = f"T={row['temperature']:g} draft tokens {row['draft_tokens']}" + (
                f" seed {row['seed']}" if row["temperature"] else ""
            )
            for name, m in row["matrices"].items():
                print(f"{setting} {name}: mean AL {fmt(m['mean'])}, ID {fmt(m['id_mean'])}, OOD {fmt(m['ood_mean'])}")
        if "vllm" in results:
            from megatron_osprey.eval.vllm_metrics import print_failures

            print((Path(config.output) / "vllm.md").read_text())
            if print_failures(results["vllm"]):
                return 1
        mismatches = results["lossless"]["mismatches"]
        if mismatches:
            for m in mismatches[:10]:
                print(
                    f"LOSSLESS MISMATCH: drafter {m['drafter']} split {m['split']} request {m['id']} "
                    f"differs from target-only greedy at token {m['index']}",
                    file=sys.stderr,
                )
            print(f"error: {len(mismatches)} request(s) differ from target-only greedy decoding.", file=sys.stderr)
            return 1
        if config.verify_lossless:
            print("lossless: every request matched target-only greedy decoding token for token")
        print(f"wrote {config.output}/results.json, matrix.md, matrix.png")
        return 0

    from megatron_osprey.base.engines import EngineUnavailable

    return exit_code(evaluate_and_report, also=(EngineUnavailable,))


if __name__ == "__main__":
    # Deprecated for one release: hands over to the job door (`python -m megatron_osprey evaluate`) by exec,
    # so the job never imports this file twice; the recipe registry above the stages is the door's to import.
    from megatron_osprey.stages.cli import deprecated_module_door

    deprecated_module_door("evaluate")
