"""Stage 4: distill the adapted drafter against a frozen target (TTT loss), online or from a hidden-state store.

    torchrun --nproc_per_node=N -m megatron_osprey distill --drafter-init ADAPTED_DIR --target TARGET_DIR \\
        --mode online --data-path CONVERSATIONS.jsonl [--eval-data DOMAIN=HELD_OUT.jsonl ...] \\
        | --mode offline --hidden-states STORE \\
        | --mode on-policy --data-path PROMPTS.jsonl (--drafter-init: the distill stage's --save; Draft-OPD's
          online loop; --opd-target-backend megatron: rolled out on the Megatron-Core target at this job's TP/EP
          layout) | --mode on-policy --opd-form offline --hidden-states ROLLOUT_STORE \\
        [--recipe NAME[:DOMAIN] [--run-dir DIR]] [flags ...] [--set section.key=value ...]

Defaults are the paper's adaptation settings: lr 1e-4, 4% warmup, cosine to 0, no weight decay, clip 1.0,
seq 4096, TTT 5 (losses/config.py), and the release's AdamW betas (0.9, 0.999); `--adam-beta2 0.95` is the value
this stage used before (the GPT-pretraining convention Stage 2 keeps). The training itself is
training/distillation.py on the shared assembly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_osprey.config.flags import under
from megatron_osprey.data.config import DISTILL_DATA_FLAGS, DISTILL_MODES, OPD_FORMS, DistillDataConfig
from megatron_osprey.losses.config import TTT_FLAGS, TTTLossConfig
from megatron_osprey.models.drafter.config import DRAFTER_FLAGS, DistillDrafterConfig
from megatron_osprey.models.target.config import TARGET_BACKENDS, TARGET_FLAGS, TARGET_LAYOUT_FLAGS, TargetConfig
from megatron_osprey.parallel.config import LOADING_TIMEOUT_FLAG, ParallelConfig
from megatron_osprey.stages.cli import (
    Invocation,
    parse_config,
    train_main,
    train_on_every_rank,
)
from megatron_osprey.stages.pretrain import SHARED_TRAINING_FLAGS
from megatron_osprey.training.config import (
    ADAM_BETA2_RELEASE,
    CheckpointConfig,
    LoggingConfig,
    OptimizerConfig,
    TrainingConfig,
    validate_optimizer,
    validate_training,
)


def _adaptation_optimizer() -> OptimizerConfig:
    """The paper's adaptation schedule and the release's AdamW betas (0.9, 0.999); Stage 2's defaults are the
    optimizer's own (beta2 0.95, training/config.py's ADAM_BETA2_GPT, a named value here: `--adam-beta2 0.95`)."""
    return OptimizerConfig(
        lr=1e-4, min_lr=0.0, lr_warmup_fraction=0.04, weight_decay=0.0, clip_grad=1.0, adam_beta2=ADAM_BETA2_RELEASE
    )


@dataclasses.dataclass
class DistillConfig:
    """Everything Stage 4 runs from: the drafter, the frozen target, the data, the TTT loss and training."""

    drafter: DistillDrafterConfig = dataclasses.field(default_factory=DistillDrafterConfig)
    target: TargetConfig = dataclasses.field(default_factory=TargetConfig)
    data: DistillDataConfig = dataclasses.field(default_factory=DistillDataConfig)
    ttt: TTTLossConfig = dataclasses.field(default_factory=TTTLossConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=_adaptation_optimizer)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)

    def _validate_on_policy(self) -> None:
        """On-policy starts from an SFT-distilled drafter (the distill stage's --save) and reads a rollout store."""
        init = self.drafter.drafter_init
        if self.drafter.baseline or not init:
            raise ValueError(
                "--mode on-policy starts from an SFT-distilled drafter: pass --drafter-init DISTILL_SAVE_DIR (the "
                "distill stage's --save), not --baseline."
            )
        if not (Path(init) / "latest_checkpointed_iteration.txt").is_file():
            raise FileNotFoundError(
                f"--drafter-init {init}: no latest_checkpointed_iteration.txt there; --mode on-policy starts from "
                f"the distill stage's --save directory."
            )
        data = self.data
        if data.opd_form not in OPD_FORMS:
            raise ValueError(f"--opd-form must be one of {OPD_FORMS}, got {data.opd_form!r}.")
        if data.opd_form == "offline" and not data.hidden_states:
            raise ValueError("--opd-form offline needs --hidden-states ROLLOUT_STORE (the rollout stage's output).")
        if data.opd_form == "online":
            if data.hidden_states:
                raise ValueError(
                    "--hidden-states: the online Draft-OPD form rolls out its own data each round from --data-path "
                    "PROMPTS.jsonl; a rollout store trains with --opd-form offline."
                )
            if data.opd_target_backend not in TARGET_BACKENDS:
                raise ValueError(
                    f"--opd-target-backend must be one of {TARGET_BACKENDS}, got {data.opd_target_backend!r}."
                )
            expert_parallel = self.target.expert_model_parallel_size or self.parallel.expert_model_parallel_size
            if data.opd_target_backend == "hf" and expert_parallel != 1:
                raise ValueError(
                    "--target-expert-model-parallel-size: the online Draft-OPD form's HF rollout holds the whole "
                    "target on each rank; add --opd-target-backend megatron (the Megatron-Core target at the job's "
                    "TP/EP layout)."
                )
            if len(data.data_path) != 1:
                raise ValueError("--opd-form online needs one --data-path PROMPTS.jsonl (conversations to prompt).")
            for flag, value in (
                ("--opd-limit", 1 if data.opd_limit is None else data.opd_limit),
                ("--opd-round-updates", data.opd_round_updates),
                ("--opd-max-new-tokens", data.opd_max_new_tokens),
            ):
                if value < 1:
                    raise ValueError(f"{flag} must be >= 1, got {value}.")

    def validate(self, world_size: int) -> None:
        """Checks that need no model or data."""
        drafter, target, data = self.drafter, self.target, self.data
        if data.mode == "on-policy":
            self._validate_on_policy()
        drafter.validate()
        if data.mode != "on-policy" and drafter.drafter_init and not (Path(drafter.drafter_init) / "megatron").is_dir():
            raise FileNotFoundError(
                f"--drafter-init {drafter.drafter_init}: no megatron/ there (expected the output of the adapt stage)."
            )
        if not target.path or not (Path(target.path) / "config.json").is_file():
            raise FileNotFoundError(f"--target {target.path}: no config.json there (a HF model directory).")
        if data.mode not in DISTILL_MODES:
            raise ValueError(f"--mode must be one of {DISTILL_MODES}, got {data.mode!r}.")
        if data.mode == "offline" and not data.hidden_states:
            raise ValueError("--mode offline needs --hidden-states STORE (the extract stage's output).")
        if data.mode == "online" and not data.data_path:
            raise ValueError("--mode online needs --data-path CONVERSATIONS.jsonl.")
        for path in data.data_path:
            if not Path(path).is_file():
                raise FileNotFoundError(f"--data-path {path} does not exist.")
        for domain, path in data.held_out_sets().items():
            if data.mode != "online":
                raise ValueError("--eval-data runs the held-out files through the online target: use --mode online.")
            if not Path(path).is_file():
                raise FileNotFoundError(f"--eval-data {domain}={path}: {path} does not exist.")
        if self.parallel.pipeline_model_parallel_size != 1:
            raise ValueError(
                "distillation runs the drafter and the online target without pipeline parallelism: use "
                "--pipeline-model-parallel-size 1 (extract hidden states with PP and train --mode offline "
                "for targets that need it)."
            )
        target.fold_into(self.parallel)
        if self.ttt.ttt_steps < 1:
            raise ValueError(f"--ttt-steps must be >= 1, got {self.ttt.ttt_steps}.")
        validate_training(self.training, self.parallel, world_size)
        validate_optimizer(self.optimizer, self.training)


FLAGS = {
    "drafter": under("drafter", DRAFTER_FLAGS) + under("ttt", TTT_FLAGS),
    "target and data": under("target", TARGET_FLAGS + TARGET_LAYOUT_FLAGS)
    + under("parallel", [LOADING_TIMEOUT_FLAG])
    + under("data", DISTILL_DATA_FLAGS),
    **SHARED_TRAINING_FLAGS,
}


def _inputs(config: DistillConfig) -> dict:
    """What distillation reads: the adapted drafter, the conversations and (offline) the hidden-state store."""
    inputs = {f"data{i}": path for i, path in enumerate(config.data.data_path)}
    if config.data.mode == "on-policy":  # the SFT-distilled checkpoint and the rollout store (offline form)
        inputs["drafter_init"] = config.drafter.drafter_init
        if config.data.opd_form == "offline":
            inputs["hidden_states"] = config.data.hidden_states
        return inputs
    if config.drafter.drafter_init:
        init = Path(config.drafter.drafter_init)
        inputs |= {"drafter_init": init / "megatron", "drafter_config": init / "run_config.yaml"}
    if config.data.mode == "offline":
        inputs["hidden_states"] = config.data.hidden_states
    return inputs


def run(config: DistillConfig, invocation: Invocation = Invocation("distill")):
    """Distill; every rank of the job calls it. Online, the frozen target runs on the same ranks and
    model-parallel groups; offline, the ranks read the hidden-state store instead.

    With --save, SAVE/provenance.json records the checkpoint that export and evaluate read."""
    from megatron_osprey.training.distillation import online_opd, run_distill

    def train(cfg: DistillConfig, state):
        return run_distill(cfg, state, online_rollout(cfg, state) if online_opd(cfg) else None)

    config.target.fold_into(config.parallel)  # the --target-* sizes shape the process groups the job starts with
    return train_on_every_rank(config, invocation, _inputs(config), train, _outputs)


def online_rollout(config: DistillConfig, state):
    """Draft-OPD's online rollout on this rank (collective under --opd-target-backend megatron): the target in the
    drafter's dtype, the HF model whole on this rank's device (hf) or the Megatron-Core target sharded over the
    job's tensor- and expert-parallel groups (megatron, the rollout stage's engine), and the --data-path prompts
    (their first user message); greedy chains of --ttt-steps drafts (the authors' speculative_num_steps = TTT
    length) up to --opd-max-new-tokens new tokens."""
    import torch
    from megatron.core import parallel_state as mpu
    from transformers import AutoTokenizer

    from megatron_osprey.eval.prompts import load_prompts
    from megatron_osprey.speculative import SpecConfig
    from megatron_osprey.speculative.online_rollout import OnlineRollout
    from megatron_osprey.stages.rollout import target_eos_ids
    from megatron_osprey.training.distillation import distilled_arch

    data, path = config.data, config.target.path
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = load_prompts(data.data_path[0], tokenizer, data.opd_limit, data.enable_thinking)
    dtype = torch.bfloat16 if config.drafter.bf16 else torch.float32
    aux_ids = list(distilled_arch(config.drafter.drafter_init).aux_layer_ids)
    spec = SpecConfig(
        steps=config.ttt.ttt_steps, max_new_tokens=data.opd_max_new_tokens, eos_token_ids=target_eos_ids(path)
    )
    target, states, replica = _rollout_target(config, state, aux_ids, dtype)
    tp_group = mpu.get_tensor_model_parallel_group()
    return OnlineRollout(target, states, prompts, spec, state.device, dtype, tp_group, replica)


def _rollout_target(config: DistillConfig, state, aux_ids: list[int], dtype):
    """(target, states, replica) for OnlineRollout: a decoding adapter over the aux layers, its fresh forward, and
    the ranks that decode together (None: this rank alone, with the HF target)."""
    if config.data.opd_target_backend == "hf":
        from transformers import AutoModelForCausalLM

        from megatron_osprey.models.target.decoding import HFTargetModel
        from megatron_osprey.speculative.rollout import target_states

        model = AutoModelForCausalLM.from_pretrained(config.target.path, dtype=dtype).to(state.device).eval()
        return HFTargetModel(model, aux_ids), lambda ids: target_states(model, ids, aux_ids), None
    from megatron_osprey.models.target.megatron_decoding import MegatronTargetModel
    from megatron_osprey.parallel.replicas import decoding_replica
    from megatron_osprey.speculative.rollout import megatron_target_states

    replica = decoding_replica()
    target = MegatronTargetModel.load(
        config.target.path,
        state.config,
        state.device,
        aux_ids,
        params_dtype=dtype,
        transformer_impl=config.drafter.transformer_impl,
        sync_group=replica.sync_group,
    )
    final_layer = target.model.config.num_layers - 1
    return target, lambda ids: megatron_target_states(target, ids, final_layer), replica


def _outputs(save: Path) -> dict | None:
    return {"checkpoint": save} if save.is_dir() else None


def config_from_args(argv: list[str] | None = None, recipes=None):
    """The DistillConfig these flags resolve to (a --recipe through `recipes`) and its Invocation."""
    return parse_config(argv, "distill", DistillConfig, FLAGS, __doc__, recipes)


def main(argv: list[str] | None = None, recipes=None) -> int:
    """Parse the flags, distill; returns the exit code: 2 bad input (one line), 1 a non-finite loss."""
    return train_main(*config_from_args(argv, recipes), run)


if __name__ == "__main__":
    # Deprecated for one release: hands over to the job door (`python -m megatron_osprey distill`) by exec,
    # so the job never imports this file twice; the recipe registry above the stages is the door's to import.
    from megatron_osprey.stages.cli import deprecated_module_door

    deprecated_module_door("distill")
