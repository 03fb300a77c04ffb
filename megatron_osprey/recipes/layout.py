"""The one run-directory layout: where every stage of a chain writes, and so what the next one reads.

    RUN_DIR/prune/        megatron/, hf/, run_config.yaml           (Stage 1)
    RUN_DIR/preprocess/   text_<key>_document.bin/.idx              (Stage 2's data; from a directory of
                          or 0000i/text_<key>_document.bin/.idx    shards, one subdirectory per shard)
    RUN_DIR/pretrain/     iter_*/, hf/, run_config.yaml             (Stage 2: the backbone adapt reads)
    RUN_DIR/adapt/        megatron/, hf/, tokenizer_alignment.json  (Stage 3: the drafter init distill reads)
    RUN_DIR/regenerate/   conversations.jsonl                       (target-regenerated training data)
    RUN_DIR/extract/      the hidden-state store                    (offline distillation)
    RUN_DIR/rollout/      the rollout store                         (Draft-OPD: on-policy distillation)
    RUN_DIR/distill/      iter_*/, run_config.yaml                  (Stage 4: what export and evaluate read)
    RUN_DIR/export/       the serving export
    RUN_DIR/evaluate/     results.json, matrix.md, matrix.png
    RUN_DIR/logs/         job logs and rendered sbatch scripts

Every stage also writes its provenance.json there (a stage whose output is one file or prefix among others,
preprocess, regenerate and suite, writes OUTPUT.provenance.json beside it instead). A stage whose producer is not
in the recipe's chain reads the recipe's external input instead (paths.backbone, paths.conversations, ...).
"""

from __future__ import annotations

from pathlib import Path

from megatron_osprey.eval.config import DrafterSpec

CONVERSATIONS_FILE = "conversations.jsonl"
TEXT_PREFIX = "text"


def stage_dir(run_dir: str | Path, stage: str) -> str:
    """RUN_DIR/<stage>."""
    return str(Path(run_dir) / stage)


def logs_dir(run_dir: str | Path) -> str:
    return str(Path(run_dir) / "logs")


def _training_outputs(recipe, config, save: str) -> None:
    """A training stage saves and resumes in its own directory, logs there, and saves on the time-limit signal."""
    config.checkpoint.save = config.checkpoint.load = save
    config.training.exit_signal_handler = True
    config.logging.tensorboard_dir = f"{save}/tensorboard"
    if config.logging.wandb_project:
        config.logging.wandb_exp_name = recipe.run_name


def conversations(recipe, run_dir: str) -> str:
    """The training conversations: what the chain's regenerate stage wrote, else the external file."""
    if "regenerate" in recipe.chain:
        return str(Path(stage_dir(run_dir, "regenerate")) / CONVERSATIONS_FILE)
    return recipe.path("conversations")


def backbone(recipe, run_dir: str) -> str:
    """The backbone adapt reads: the chain's pretrained one, else its pruned one, else paths.backbone."""
    for producer in ("pretrain", "prune"):
        if producer in recipe.chain:
            return stage_dir(run_dir, producer)
    return recipe.path("backbone")


def wire_paths(recipe, stage: str, config, run_dir: str) -> None:
    """Fill `config` (the recipe's config of `stage`) with the paths of `run_dir`."""
    out = stage_dir(run_dir, stage)
    if stage == "prune":
        config.source, config.output = recipe.path("source"), out
    elif stage == "preprocess":
        config.input = recipe.path("pretrain_text")
        config.tokenizer = f"{stage_dir(run_dir, 'prune')}/hf" if "prune" in recipe.chain else recipe.path("source")
        config.output_prefix = str(Path(out) / TEXT_PREFIX)
    elif stage == "pretrain":
        config.model.backbone = stage_dir(run_dir, "prune") if "prune" in recipe.chain else recipe.path("backbone")
        if "preprocess" in recipe.chain:
            preprocess = recipe.config("preprocess", run_dir)
            config.data.data_path = preprocess.output_paths()
        _training_outputs(recipe, config, out)
    elif stage == "adapt":
        config.backbone, config.target, config.output = backbone(recipe, run_dir), recipe.path("target"), out
        if config.draft_vocab_size:
            config.token_counts = recipe.path("token_counts")
    elif stage == "regenerate":
        config.input, config.output = recipe.path("prompts"), str(Path(out) / CONVERSATIONS_FILE)
        if config.backend == "hf":
            config.model = recipe.path("target")
    elif stage == "extract":
        config.target.path, config.data_path = recipe.path("target"), conversations(recipe, run_dir)
        config.store.store_dir = out
    elif stage == "rollout":
        config.target, config.drafter = recipe.path("target"), recipe.path("sft")
        config.data_path, config.output = conversations(recipe, run_dir), out
    elif stage == "distill":
        config.target.path = recipe.path("target")
        if (
            config.data.mode == "on-policy"
        ):  # Draft-OPD: from the SFT-distilled drafter (rollouts: its own or the chain's)
            config.drafter.drafter_init = recipe.path("sft")
        elif not config.drafter.baseline:
            config.drafter.drafter_init = stage_dir(run_dir, "adapt")
        config.data.data_path = [conversations(recipe, run_dir)]
        if config.data.mode == "offline":
            config.data.hidden_states = stage_dir(run_dir, "extract")
        elif config.data.mode == "on-policy" and config.data.opd_form == "offline":
            config.data.hidden_states = stage_dir(run_dir, "rollout")
        config.data.domain = recipe.domain
        _training_outputs(recipe, config, out)
    elif stage == "export":
        config.checkpoint, config.output = stage_dir(run_dir, "distill"), out
    elif stage == "evaluate":
        distill = recipe.distill
        method = "eagle3" if distill is not None and distill.drafter.baseline else "osprey"
        name = f"{method}_{recipe.domain}" if recipe.domain else method
        config.target, config.output = recipe.path("target"), out
        config.drafters = [DrafterSpec(name, Path(stage_dir(run_dir, "distill")), recipe.domain, method)]
        config.data = [recipe.path("eval_data", domain) for domain in recipe.eval_domains]
    else:
        raise ValueError(f"stage {stage!r} has no place in the run-directory layout.")
