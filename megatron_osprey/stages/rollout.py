"""Draft-OPD rollout: the current drafter and the target decode the training prompts; every verify round is stored.

    python -m megatron_osprey.stages.rollout --target TARGET_DIR --drafter DISTILL_SAVE_DIR \\
        --data CONVERSATIONS.jsonl --output ROLLOUT_STORE [--steps 5] [--top-k 32] [--max-new-tokens 256] [--limit N]

Greedy chain speculative decoding through the reference engine (speculative/rollout.py): the continuation is the
target's own, verified output. ROLLOUT_STORE is a hidden-state store (the extract stage's format) with the
rollout feature: each sample is one prompt plus its verified continuation (loss mask on the continuation), the
target's aux and final hidden states over it, and its verify rounds: the root row, the drafted tokens, the
number accepted (the rejection position) and the target's top-k probabilities at every drafted position
(data/hidden_state_store/rollout.py). `distill --mode on-policy --hidden-states ROLLOUT_STORE` trains on it;
rollout -> train rounds can repeat with the new checkpoint as --drafter.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from megatron_osprey.base.outputs import check_output, prepare_output
from megatron_osprey.base.provenance import PROVENANCE_FILE
from megatron_osprey.config.flags import STORE_TRUE, Flag, boolean
from megatron_osprey.stages.cli import Invocation, check_inputs, exit_code, parse_config

ROLLOUT_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass
class RolloutConfig:
    """The rollout's inputs, its draft shape and the store it writes."""

    target: str | None = None  # the HF target directory
    drafter: str | None = None  # any drafter the eval loads (a distill --save directory: the SFT-distilled one)
    data_path: str | None = None  # conversations JSONL: the training prompts
    output: str | None = None
    steps: int = 5  # drafted tokens per verify round (the chain length K)
    top_k: int = 32  # target probabilities kept per drafted position
    max_new_tokens: int = 256
    limit: int | None = None
    prompt_messages: str = "first_user"
    enable_thinking: bool | None = None
    dtype: str = "float32"
    samples_per_shard: int = 64
    overwrite: bool = False

    def validate(self) -> None:
        """Flags and paths, before any model is loaded."""
        for flag, value in (("--target", self.target), ("--drafter", self.drafter), ("--data", self.data_path)):
            if not value:
                raise ValueError(f"{flag} is required.")
        if not self.output:
            raise ValueError("--output is required (the rollout store's directory).")
        if not (Path(self.target) / "config.json").is_file():
            raise FileNotFoundError(f"--target {self.target}: no config.json there (a HF model directory).")
        if not Path(self.drafter).is_dir():
            raise FileNotFoundError(f"--drafter {self.drafter}: no such directory.")
        if not Path(self.data_path).is_file():
            raise FileNotFoundError(f"--data {self.data_path} does not exist.")
        for flag, value in (
            ("--steps", self.steps),
            ("--top-k", self.top_k),
            ("--max-new-tokens", self.max_new_tokens),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}.")
        if self.dtype not in ROLLOUT_DTYPES:
            raise ValueError(f"--dtype must be one of {ROLLOUT_DTYPES}, got {self.dtype!r}.")
        check_output(self.output, self.paths_read(), PROVENANCE_FILE, self.overwrite, stage="rollout")

    def paths_read(self) -> dict[str, str | None]:
        return {"--target": self.target, "--drafter": self.drafter, "--data": self.data_path}


FLAGS = {
    "rollout": [
        Flag("--target", "target", {"help": "the HF target directory"}),
        Flag("--drafter", "drafter", {"help": "the SFT-distilled drafter (the distill stage's --save)"}),
        Flag("--data", "data_path", {"help": "conversations JSONL: the training prompts"}),
        Flag("--output", "output", {"help": "the rollout store's directory"}),
        Flag("--steps", "steps", {"type": int, "help": "drafted tokens per verify round (5)"}),
        Flag("--top-k", "top_k", {"type": int, "help": "target probabilities stored per drafted position (32)"}),
        Flag("--max-new-tokens", "max_new_tokens", {"type": int}),
        Flag("--limit", "limit", {"type": int, "help": "only the first N prompts"}),
        Flag("--prompt-messages", "prompt_messages", {"help": "first_user (default) or before_assistant"}),
        Flag("--enable-thinking", "enable_thinking", {"type": boolean, "metavar": "true|false"}),
        Flag("--dtype", "dtype", {"choices": list(ROLLOUT_DTYPES)}),
        Flag("--samples-per-shard", "samples_per_shard", {"type": int}),
        Flag("--overwrite", "overwrite", {**STORE_TRUE, "help": "replace this stage's earlier output in --output"}),
    ]
}


def _load(config: RolloutConfig):
    """(HF target model, tokenizer, the drafter as a ReferenceDrafter on the target's device and dtype)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_osprey.eval.loading import load_drafter
    from megatron_osprey.models.drafter.reference import ReferenceDrafter

    loaded = load_drafter(config.drafter, "--drafter")
    if not isinstance(loaded.drafter, ReferenceDrafter):
        raise ValueError(f"--drafter {config.drafter} is a {loaded.source} drafter; the rollout trains a neural one.")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, config.dtype)
    model = AutoModelForCausalLM.from_pretrained(config.target, dtype=dtype).to(device).eval()
    if loaded.drafter.config.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"--drafter {config.drafter} drafts over {loaded.drafter.config.vocab_size} tokens, --target "
            f"{config.target} has {model.config.vocab_size}: it was adapted to another target."
        )
    return model, AutoTokenizer.from_pretrained(config.target), loaded.drafter.to(device=device, dtype=dtype)


def run(config: RolloutConfig, invocation: Invocation = Invocation("rollout")):
    """Roll out every prompt and write the finalized rollout store; returns the SpecResults."""
    from megatron_osprey.base.arch import ModelArch
    from megatron_osprey.data.hidden_state_store import HiddenStateWriter, finalize_store
    from megatron_osprey.eval.prompts import load_prompts
    from megatron_osprey.models.target.pipeline_stage import target_identity
    from megatron_osprey.speculative import HFTargetModel, ReferenceDraftSession, SpecConfig
    from megatron_osprey.speculative.rollout import rollout, target_states

    config.validate()
    inputs = check_inputs({"target": config.target, "conversations": config.data_path})
    model, tokenizer, drafter = _load(config)
    aux_ids = list(drafter.config.aux_layer_ids)
    prompts = load_prompts(config.data_path, tokenizer, config.limit, config.enable_thinking, config.prompt_messages)
    target_id, config_hash = target_identity(ModelArch.from_hf_config(config.target), config.target)
    output = prepare_output(config.output, config.paths_read(), PROVENANCE_FILE, config.overwrite, stage="rollout")
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    spec = SpecConfig(
        steps=config.steps,
        max_new_tokens=config.max_new_tokens,
        eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
    )
    target, session, results = HFTargetModel(model, aux_ids), ReferenceDraftSession(drafter), []
    writer = HiddenStateWriter(
        output,
        target_id=target_id,
        config_hash=config_hash,
        aux_layer_ids=aux_ids,
        hidden_size=model.config.hidden_size,
        samples_per_shard=config.samples_per_shard,
        rollout_steps=config.steps,
        rollout_top_k=min(config.top_k, model.config.vocab_size),
    )
    with writer:
        for prompt in prompts:
            done = rollout(target, session, prompt.input_ids, spec, writer.header.rollout_top_k)
            aux, final = target_states(model, done.input_ids, aux_ids)
            writer.add(prompt.id, done.input_ids, done.loss_mask, aux.float(), final.float(), rollout=done.rounds)
            results.append(done.result)
    finalize_store(output)
    invocation.record(output, config, inputs, {"store": output / "manifest.json"})
    return results


def main(argv: list[str] | None = None, recipes=None) -> int:
    """Parse the flags, roll out, print a summary; returns the exit code (2: bad input, one line)."""
    config, invocation = parse_config(argv, "rollout", RolloutConfig, FLAGS, __doc__, recipes)

    def roll_and_report() -> None:
        from megatron_osprey.speculative import acceptance_summary

        summary = acceptance_summary(run(config, invocation))
        print(
            f"rollout: {summary['requests']} prompts, {summary['verify_count']} verify rounds stored, mean acceptance "
            f"length {summary['mean_acceptance_length']:.2f} -> {config.output}"
        )

    return exit_code(roll_and_report)


if __name__ == "__main__":
    # The job door, as every stage's: the recipe registry resolves --recipe (no recipe holds this stage).
    from megatron_osprey.recipes import run_stage

    sys.exit(run_stage("rollout"))
