"""The demo's arms, from backbone to evaluation: Stage 1-3 per arm (the target-pruned backbone and, with
`cross_tokenizer`, a small LM of another tokenizer), the target's regenerated conversations and hidden states,
Stage 4 for every arm and the EAGLE-3 baseline, and the train x eval acceptance-length matrix."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_osprey.demo.commands import distill_argv, eval_argv, pretrain_argv
from megatron_osprey.demo.sizes import DemoConfig
from megatron_osprey.demo.step_runner import StepRunner


def preprocess_general(
    steps: StepRunner, output: Path, data: dict, tokenizer_dir: Path, name: str, source: Path | None = None
) -> Path:
    """The general mix (or the text JSONL `source`), tokenized with `name`'s tokenizer into Megatron's indexed
    format; returns its prefix."""
    prefix = output / "data" / f"general_{name}"
    steps.run(
        f"preprocess_general_{name}",
        [
            "tools/preprocess_data.py",
            "--input",
            source or data["general"],
            "--json-key",
            "text",
            "--tokenizer",
            tokenizer_dir,
            "--output-prefix",
            prefix,
            "--workers",
            "1",
            "--overwrite",
        ],
    )
    return prefix


def backbone_steps(
    steps: StepRunner,
    cfg: DemoConfig,
    output: Path,
    source: Path,
    prefix: Path,
    target: Path,
    name: str,
    iters: int | None = None,
) -> Path:
    """Stage 1 (prune to 2 layers), Stage 2 (continue pretraining on the general mix at `prefix` for `iters`
    steps, default cfg.backbone_iters), Stage 3 (adapt)."""
    steps.run(
        f"prune_{name}",
        [
            "tools/prune_backbone.py",
            "--source",
            source,
            "--num-layers",
            "2",
            "--output",
            output / f"pruned_{name}",
            "--overwrite",
        ],
    )
    steps.run(
        f"pretrain_backbone_{name}",
        pretrain_argv(
            cfg,
            "--backbone",
            output / f"pruned_{name}",
            Path(f"{prefix}_text_document"),
            output / f"backbone_{name}",
            iters or cfg.backbone_iters,
            cfg.backbone_lr,
        ),
    )
    init = output / f"drafter_init_{name}"
    steps.run(
        f"adapt_{name}",
        [
            "tools/adapt_drafter.py",
            "--backbone",
            output / f"backbone_{name}",
            "--target",
            target,
            "--output",
            init,
            "--overwrite",
        ],
    )
    return init


def train_small_lm(steps: StepRunner, cfg: DemoConfig, output: Path, data: dict) -> tuple[Path, Path]:
    """The cross-tokenizer arm's off-the-shelf small LM: a from-scratch Qwen3-style LM with another real
    tokenizer, trained on the general mix (which holds no eval text). Returns its HF checkpoint and the prefix
    of the general mix in its tokenization."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from megatron_osprey.assets import get_tokenizer_dir, load_tokenizer

    small = cfg.cross_tokenizer
    init = output / "small_lm_init"
    if not (init / "config.json").is_file():
        tokenizer = load_tokenizer(small.tokenizer)
        torch.manual_seed(cfg.seed)
        Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=len(tokenizer),
                hidden_size=small.hidden,
                intermediate_size=small.ffn,
                num_hidden_layers=small.layers,
                num_attention_heads=small.heads,
                num_key_value_heads=small.kv_heads,
                head_dim=small.hidden // small.heads,
                max_position_embeddings=2048,
                tie_word_embeddings=True,
                eos_token_id=tokenizer.eos_token_id,
            )
        ).save_pretrained(init)
        tokenizer.save_pretrained(init)
    prefix = preprocess_general(steps, output, data, get_tokenizer_dir(small.tokenizer), "small_lm")
    steps.run(
        "train_small_lm",
        pretrain_argv(cfg, "--hf-model", init, Path(f"{prefix}_text_document"), output / "small_lm", small.iters, 3e-3),
    )
    return output / "small_lm" / "hf", prefix


def build_backbones(steps: StepRunner, cfg: DemoConfig, output: Path, data: dict, target: Path) -> dict[str, Path]:
    """Stage 1-3 for every arm; returns each Osprey arm's adapted drafter init."""
    general = preprocess_general(steps, output, data, target, "target")
    inits = {"osprey": backbone_steps(steps, cfg, output, target, general, target, "target")}
    if cfg.cross_tokenizer:  # the small LM is trained and pruned on the same tokenization of the general mix
        small, small_general = train_small_lm(steps, cfg, output, data)
        inits["osprey_xtok"] = backbone_steps(steps, cfg, output, small, small_general, target, "small_lm")
    return inits


def regenerate_and_extract(
    steps: StepRunner,
    cfg: DemoConfig,
    output: Path,
    data: dict,
    target: Path,
    vllm_python: str | None = None,
    serve: bool = True,
) -> tuple[dict[str, Path], dict[str, Path]]:
    """Per training domain, the target's regenerated conversations (osprey data's training prompts, sampled at
    cfg.regenerate_temperature with cfg.seed) and its hidden-state store on them. Where the vLLM engine is installed
    (`vllm_python`, else the checkout's .venv-vllm) the regenerate stage serves the target in vLLM, else it runs the
    target in-process."""
    served = regeneration_server(vllm_python, serve)
    regenerated, stores = {}, {}
    for domain in cfg.train_domains:
        prompts = data["splits"][domain]["train"]
        regenerated[domain], stores[domain] = regenerate_one(steps, cfg, output, domain, prompts, target, served)
    return regenerated, stores


def regenerate_one(
    steps: StepRunner, cfg: DemoConfig, output: Path, name: str, prompts: Path, target: Path, served: list
) -> tuple[Path, Path]:
    """The target's answers to `prompts` (steps regenerate_NAME, then extract_NAME into stores/NAME) with the
    regeneration settings every arm shares; (the conversations, the store)."""
    path = output / "data" / f"{name}_regenerated.jsonl"
    steps.run(
        f"regenerate_{name}",
        [
            "tools/regenerate.py",
            "--input",
            prompts,
            "--output",
            path,
            *served,
            "--model",
            target,
            "--temperature",
            str(cfg.regenerate_temperature),
            "--seed",
            str(cfg.seed),
            "--max-tokens",
            str(cfg.regenerate_tokens),
            "--concurrency",
            "16",
            "--no-progress",
            "--dtype",
            "bfloat16" if cfg.bf16 else "float32",
            "--overwrite",
        ],
    )
    store = output / "stores" / name
    steps.run(
        f"extract_{name}",
        [
            "tools/extract_hidden_states.py",
            "--target",
            target,
            "--data",
            path,
            "--output",
            store,
            "--max-length",
            str(cfg.seq_length),
            "--micro-batch-size",
            "8",
            "--params-dtype",
            "float32",
            "--overwrite",
        ],
    )
    return path, store


# The regenerate stage's vLLM server: the demo's prompts and replies are short (the context is the server's KV-cache
# budget, not the target's 8192).
DEMO_MAX_MODEL_LEN = 2048


def regeneration_server(vllm_python: str | None, serve: bool = True) -> list[str]:
    """The regenerate flags that serve the target: vLLM's server where the engine is installed (and `serve`),
    else in-process."""
    from megatron_osprey.base.engines import EngineUnavailable, engine_python, engine_version

    if not serve:
        return ["--backend", "hf", "--batch-size", "16"]
    repo = Path(__file__).resolve().parents[2]
    try:
        python = engine_python("vllm", vllm_python, {}, repo=repo)
        engine_version("vllm", python)
    except EngineUnavailable as error:
        print(f"    regenerate: in-process target ({error})", flush=True)
        return ["--backend", "hf", "--batch-size", "16"]
    return ["--serve", "vllm", "--vllm-python", python, "--max-model-len", str(DEMO_MAX_MODEL_LEN)]


def drafter_name(method: str, domain: str, seed: int, cfg: DemoConfig) -> str:
    """A drafter's name (and its directory under drafters/): method, training domain and, with seeds, the seed."""
    return f"{method}_{domain}" + (f"_s{seed}" if len(cfg.seeds) > 1 else "")


def distill_drafters(
    steps: StepRunner,
    cfg: DemoConfig,
    output: Path,
    target: Path,
    inits: dict[str, Path],
    regenerated: dict[str, Path],
    stores: dict[str, Path],
) -> list[dict]:
    """Stage 4: every Osprey arm and the EAGLE-3 baseline per training domain and seed, matched budgets."""
    from transformers import AutoConfig

    arms = [("osprey", "target")] + ([("osprey_xtok", "small_lm")] if cfg.cross_tokenizer else [])
    draft_vocab = cfg.draft_vocab_size(AutoConfig.from_pretrained(target).vocab_size)
    drafters = []
    for seed in cfg.seeds:
        for domain in cfg.train_domains:
            for method, init in [*((m, inits[m]) for m, _ in arms), ("eagle3", None)]:
                name = drafter_name(method, domain, seed, cfg)
                save = output / "drafters" / name
                steps.run(
                    f"distill_{name}",
                    distill_argv(
                        cfg, method, init, target, domain, regenerated[domain], stores[domain], save, seed, draft_vocab
                    ),
                )
                drafters.append({"name": name, "method": method, "domain": domain, "seed": seed, "path": save})
    return drafters


def evaluate_drafters(
    steps: StepRunner,
    cfg: DemoConfig,
    target: Path,
    eval_dir: Path,
    drafters: list[dict],
    data: dict,
    name: str = "eval",
) -> None:
    """The train x eval acceptance-length matrix into `eval_dir` (one step `name`, or one per seed merged), and
    with `eval_replay` the live, lossless-checked decoding of seed 0 on a few prompts per domain."""
    seeds = [s for s in cfg.seeds if any(d["seed"] == s for d in drafters)]  # the extra arms may train fewer
    if len(cfg.seeds) == 1 and not cfg.eval_replay:
        steps.run(name, eval_argv(cfg, target, eval_dir, drafters, data))
    else:  # one resumable step per seed, merged into one results.json
        from megatron_osprey.eval.run import merge_results

        for seed in seeds:
            steps.run(
                f"{name}_s{seed}",
                eval_argv(
                    cfg,
                    target,
                    eval_dir / f"seed{seed}",
                    [d for d in drafters if d["seed"] == seed],
                    data,
                    cfg.eval_replay,
                ),
            )
        merge_results([json.loads((eval_dir / f"seed{seed}" / "results.json").read_text()) for seed in seeds], eval_dir)
    if cfg.eval_replay:
        steps.run(
            f"{name}_live_check",
            eval_argv(
                cfg,
                target,
                eval_dir / "live_check",
                [d for d in drafters if d["seed"] == cfg.seeds[0]],
                data,
                limit=cfg.live_check_prompts,
            ),
        )
