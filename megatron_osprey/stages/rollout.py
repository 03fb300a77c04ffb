"""Draft-OPD rollout: the current drafter and the target decode the training prompts; every verify round is stored.

    python -m megatron_osprey rollout --target TARGET_DIR --drafter DISTILL_SAVE_DIR \\
        --data CONVERSATIONS.jsonl --output ROLLOUT_STORE [--steps 5] [--top-k 32] [--max-new-tokens 256] [--limit N]
        [--temperature T [--seed S]] [--no-replay] [--target-backend hf|megatron [--tensor-model-parallel-size N]]
    torchrun --nproc-per-node N -m megatron_osprey rollout ...   (HF: N replicas, each its slice)
    torchrun --nproc-per-node N -m megatron_osprey rollout ... --target-backend megatron \\
        --tensor-model-parallel-size T   (N / T data-parallel replicas, each rolling out its slice of the prompts)
        [--sequence-parallel] [--expert-model-parallel-size E --expert-tensor-parallel-size 1]   (MoE targets)

Chain speculative decoding (greedy by default; --temperature T > 0: speculative sampling, each prompt from its
own seed derived from --seed and its id, so that the layout does not change what is sampled) through the
reference engine (speculative/rollout.py) with the HF target and its KV cache (--target-backend hf: one process,
or under torchrun one per device, each with the whole target and its slice of the prompts) or the Megatron-Core
target (megatron: the evaluate stage's exact-recompute target, sharded over a tensor-parallel group, with
sequence parallelism, and a mixture-of-experts target's experts over an expert-parallel group: a MoE target at
TP > 1 needs --sequence-parallel, as in Megatron-Core); the continuation is the target's own, verified output.
ROLLOUT_STORE is a hidden-state store (the extract stage's format) with the rollout feature: each sample is one
prompt plus its verified continuation (loss mask on the continuation), the target's aux and final hidden states
over it, and its verify rounds: the root row, the drafted tokens, the number accepted (the rejection position)
and the target's top-k probabilities at every drafted position (data/hidden_state_store/rollout.py). Unless
--no-replay, each round rejected after a >= 1 accepted drafts adds a replayed round from its rejection position
(root row t + a, drafted from the verified prefix). One writer per decoding replica (its first rank) writes its
slice; rank 0 finalizes. A replica is a tensor-parallel group, or, where an expert-parallel group reaches across
data-parallel ranks (E > T), every group it links: those ranks decode the same prompts in step.
`distill --mode on-policy --hidden-states ROLLOUT_STORE` trains on it; rollout -> train rounds can repeat with
the new checkpoint as --drafter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path

from megatron_osprey.base.outputs import check_disjoint
from megatron_osprey.base.provenance import PROVENANCE_FILE
from megatron_osprey.config.flags import STORE_TRUE, Flag, boolean, skip_checksum_flag, under
from megatron_osprey.models.backbone.config import TRANSFORMER_IMPLS
from megatron_osprey.models.target.config import TARGET_BACKENDS
from megatron_osprey.parallel.config import EXPERT_PARALLEL_FLAGS, PARALLEL_FLAGS, ParallelConfig
from megatron_osprey.stages.cli import Invocation, check_inputs, exit_code, is_rank0, parse_config

ROLLOUT_DTYPES = ("float32", "bfloat16")
_LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--sequence-parallel", "--distributed-timeout-minutes")
ROLLOUT_SETTINGS = "rollout_settings.json"  # what the store was made from: a rerun with the same resumes


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
    replay: bool = True  # a round replayed from each rejection position
    temperature: float = 0.0  # 0: greedy; > 0: speculative sampling (the continuation is the target's sample)
    seed: int = 0  # each prompt's sampling seed derives from it and the prompt's id
    # Replicas roll out slices of uneven length: how long one that finished waits for the slowest (48 h).
    replica_timeout_minutes: float = 2880.0
    target_backend: str = "hf"  # or "megatron": the Megatron-Core target (tensor-parallel under torchrun)
    # The Megatron-Core target's layers: auto is Transformer Engine on CUDA (what a MoE target or sequence
    # parallelism needs there; chains are verified with its causal mask), the local spec on the CPU.
    transformer_impl: str = "auto"
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    overwrite: bool = False
    skip_checksum: bool = False  # load a Megatron --drafter without checking its files against checksums.json

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
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}.")
        if not self.replica_timeout_minutes > 0:
            raise ValueError(f"--replica-timeout-minutes must be > 0, got {self.replica_timeout_minutes}.")
        if self.dtype not in ROLLOUT_DTYPES:
            raise ValueError(f"--dtype must be one of {ROLLOUT_DTYPES}, got {self.dtype!r}.")
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(f"--transformer-impl must be one of {TRANSFORMER_IMPLS}, got {self.transformer_impl!r}.")
        if self.target_backend not in TARGET_BACKENDS:
            raise ValueError(f"--target-backend must be one of {TARGET_BACKENDS}, got {self.target_backend!r}.")
        if self.target_backend == "hf":
            p = self.parallel
            for flag, value in (
                ("--tensor-model-parallel-size", p.tensor_model_parallel_size != 1),
                ("--expert-model-parallel-size", p.expert_model_parallel_size != 1),
                ("--sequence-parallel", p.sequence_parallel),
            ):
                if value:
                    raise ValueError(f"{flag} shards the Megatron target: add --target-backend megatron.")
        check_disjoint(self.output, self.paths_read())
        if Path(self.output).exists() and not Path(self.output).is_dir():
            raise FileExistsError(f"--output {self.output} is a file, not a directory; choose another --output.")

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
        Flag("--temperature", "temperature", {"type": float, "help": "0: greedy (default); > 0: sampled rollouts"}),
        Flag("--seed", "seed", {"type": int, "help": "per-prompt sampling seeds derive from it (sampling only)"}),
        Flag(
            "--replica-timeout-minutes",
            "replica_timeout_minutes",
            {"type": float, "help": "how long a replica that finished waits for the slowest (2880)"},
        ),
        Flag(
            "--no-replay",
            "replay",
            {"action": "store_false", "help": "record the live rounds only (no replays from rejection positions)"},
        ),
        Flag(
            "--transformer-impl",
            "transformer_impl",
            {"choices": list(TRANSFORMER_IMPLS), "help": "the Megatron-Core target's layers (auto: TE on CUDA)"},
        ),
        Flag(
            "--target-backend",
            "target_backend",
            {"choices": list(TARGET_BACKENDS), "help": "HF model (default) or Megatron-Core (tensor-parallel)"},
        ),
        Flag(
            "--overwrite",
            "overwrite",
            {**STORE_TRUE, "help": "delete a store made from other inputs or settings (the same ones resume)"},
        ),
        skip_checksum_flag("a Megatron --drafter checkpoint"),
    ],
    "distributed": under(
        "parallel",
        [
            *(f for f in PARALLEL_FLAGS if f.flag in _LAYOUT_FLAGS),
            *EXPERT_PARALLEL_FLAGS,
        ],
    ),
}


def _load_drafter(config: RolloutConfig, vocab_size: int, device, dtype):
    """The drafter as a ReferenceDrafter on the target's device and dtype, checked against the target's vocab."""
    from megatron_osprey.eval.loading import load_drafter
    from megatron_osprey.models.drafter.reference import ReferenceDrafter

    loaded = load_drafter(config.drafter, "--drafter", verify=not config.skip_checksum)
    if config.skip_checksum and loaded.source == "megatron" and is_rank0():
        from megatron_osprey.base.checksums import skipped_checksum_note

        print(skipped_checksum_note(config.drafter), file=sys.stderr, flush=True)
    if not isinstance(loaded.drafter, ReferenceDrafter):
        raise ValueError(f"--drafter {config.drafter} is a {loaded.source} drafter; the rollout trains a neural one.")
    if loaded.drafter.config.vocab_size != vocab_size:
        raise ValueError(
            f"--drafter {config.drafter} drafts over {loaded.drafter.config.vocab_size} tokens, --target "
            f"{config.target} has {vocab_size}: it was adapted to another target."
        )
    return loaded.drafter.to(device=device, dtype=dtype)


def target_eos_ids(target: str) -> tuple[int, ...]:
    """The HF target's EOS token ids (its generation_config.json, else its config.json)."""
    from transformers import AutoConfig, GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(target).eos_token_id
    except OSError:  # no generation_config.json: HF's model takes it from config.json
        eos = GenerationConfig.from_model_config(AutoConfig.from_pretrained(target)).eos_token_id
    return tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])


def _spec(config: RolloutConfig):
    """Chains of --steps drafts at --temperature, up to --max-new-tokens, stopping at the target's EOS tokens."""
    from megatron_osprey.speculative import SpecConfig

    return SpecConfig(
        steps=config.steps,
        max_new_tokens=config.max_new_tokens,
        eos_token_ids=target_eos_ids(config.target),
        temperature=config.temperature,
    )


def store_settings(config: RolloutConfig) -> dict:
    """Everything a stored rollout depends on besides its prompt's id: the data, the models and the decoding."""
    from megatron_osprey.data.fingerprint import directory_fingerprint, file_sha256, model_fingerprint

    fields = ("steps", "top_k", "max_new_tokens", "limit", "prompt_messages", "enable_thinking", "dtype", "replay")
    fields += ("temperature", "seed", "samples_per_shard", "target_backend", "transformer_impl")
    return {
        "data_sha256": file_sha256(config.data_path),
        "target": model_fingerprint(config.target),
        "drafter": directory_fingerprint(config.drafter),
        **{name: getattr(config, name) for name in fields},
    }


def claim_store(config: RolloutConfig, replicas: int = 1, say=print) -> Path:
    """Run by one process before any writer opens the store: a store from other inputs or settings is refused
    (--overwrite: deleted), one from the same is resumed; the settings are recorded. Returns the store."""
    from megatron_osprey.data.fingerprint import claim_store_dir

    store = Path(config.output)
    # A complete store written before the settings record carries only its provenance.json.
    marker = ROLLOUT_SETTINGS if (store / ROLLOUT_SETTINGS).is_file() else PROVENANCE_FILE
    # Each replica writes its own part: a store resumes only with as many (the same GPUs and layout).
    settings = store_settings(config) | {"writers (data-parallel replicas)": replicas}
    return claim_store_dir(
        store, ROLLOUT_SETTINGS, settings, config.paths_read(), overwrite=config.overwrite, stage="rollout",
        holds="rollouts", say=say, marker=marker,
    )  # fmt: skip


@dataclasses.dataclass
class RolloutRun:
    """This rank's rollout: each prompt's SpecResult, how many rounds it replayed from rejection positions, and
    how many of its prompts an earlier, interrupted run had stored already (skipped)."""

    results: list
    replays: list[int]
    skipped: int = 0


def _roll_out(config: RolloutConfig, target, states, drafter, prompts, writer, stored=frozenset()) -> RolloutRun:
    """Roll out `prompts` but those whose id is in `stored` (target: a TargetModel; states(ids) -> (aux, final));
    `writer` (or None) stores them."""
    from megatron_osprey.data.regenerate.runner import turn_seed
    from megatron_osprey.speculative import ReferenceDraftSession
    from megatron_osprey.speculative.rollout import rollout

    spec, session, run = _spec(config), ReferenceDraftSession(drafter), RolloutRun([], [])
    top_k = min(config.top_k, target.vocab_size)
    for prompt in prompts:
        if prompt.id in stored:
            run.skipped += 1
            continue
        seeded = dataclasses.replace(spec, seed=turn_seed(config.seed, prompt.id, 0))
        done = rollout(target, session, prompt.input_ids, seeded, top_k, replay=config.replay)
        aux, final = states(done.input_ids)
        if writer is not None:
            writer.add(prompt.id, done.input_ids, done.loss_mask, aux.float(), final.float(), rollout=done.rounds)
        run.results.append(done.result)
        run.replays.append(done.replays)
    return run


def _open_writer(config: RolloutConfig, output: Path, arch, aux_ids: list[int], rank: int = 0, world_size: int = 1):
    from megatron_osprey.data.hidden_state_store import HiddenStateWriter
    from megatron_osprey.models.target.pipeline_stage import target_identity

    target_id, config_hash = target_identity(arch, config.target)
    return HiddenStateWriter(
        output,
        target_id=target_id,
        config_hash=config_hash,
        aux_layer_ids=aux_ids,
        hidden_size=arch.hidden_size,
        samples_per_shard=config.samples_per_shard,
        rollout_steps=config.steps,
        rollout_top_k=min(config.top_k, arch.vocab_size),
        rank=rank,
        world_size=world_size,
    )


def _check_megatron_layout(config: RolloutConfig, arch) -> None:
    """The Megatron-Core target's layout against its shape, before any process group exists."""
    p = config.parallel
    arch.validate_parallel(p.tensor_model_parallel_size, 1, p.expert_model_parallel_size, p.sequence_parallel)


def _roll_out_job(config: RolloutConfig, arch, prompts_of) -> tuple[RolloutRun, Path]:
    """Every rank of the job (one process, or torchrun's): one process group for the drafter's load and the
    rollout (under srun a second rendezvous at the same MASTER_PORT can meet the first's stale keys), then the
    backend's rollout inside the layout's process groups."""
    import torch

    from megatron_osprey.parallel import parallel_context, process_group

    if config.target_backend == "megatron":
        _check_megatron_layout(config, arch)
    with process_group(config.parallel):
        # Before the rollout's groups: a Megatron drafter checkpoint loads in its own (every rank a replica).
        drafter = _load_drafter(config, arch.vocab_size, "cpu", getattr(torch, config.dtype))
        roll_out = _roll_out_megatron if config.target_backend == "megatron" else _roll_out_hf
        with parallel_context(config.parallel) as state:
            return roll_out(config, arch, prompts_of, drafter, state)


def _roll_out_hf(config: RolloutConfig, arch, prompts_of, drafter, state) -> tuple[RolloutRun, Path]:
    """The HF target with its KV cache on every rank: each loads the whole target and rolls out its contiguous
    slice of the prompts into its own writer; rank 0 finalizes."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_osprey.data.extract import contiguous_slice
    from megatron_osprey.data.hidden_state_store import finalize_store
    from megatron_osprey.parallel import waiting_window
    from megatron_osprey.speculative import HFTargetModel
    from megatron_osprey.speculative.rollout import target_states

    rank, world, output = state.rank, state.world_size, Path(config.output)
    dtype = getattr(torch, config.dtype)
    model = AutoModelForCausalLM.from_pretrained(config.target, dtype=dtype).to(state.device).eval()
    drafter = drafter.to(state.device)
    aux_ids = list(drafter.config.aux_layer_ids)
    prompts = prompts_of()
    mine = [prompts[i] for i in contiguous_slice(len(prompts), rank, world)]
    if rank == 0:
        claim_store(config, replicas=world)
    torch.distributed.barrier()
    target = HFTargetModel(model, aux_ids)
    states = lambda ids: target_states(model, ids, aux_ids)  # noqa: E731
    with waiting_window(config.replica_timeout_minutes):  # each rank its own slice, at its own pace
        with _open_writer(config, output, arch, aux_ids, rank, world) as writer:
            results = _roll_out(config, target, states, drafter, mine, writer, writer.completed_sample_ids())
    if rank == 0:
        finalize_store(output)
    torch.distributed.barrier()
    return results, output


def _roll_out_megatron(config: RolloutConfig, arch, prompts_of, drafter, state) -> tuple[RolloutRun, Path]:
    """The Megatron-Core target over each decoding replica (a tensor-parallel group, or the groups an
    expert-parallel group links), one writer per replica on its contiguous slice of the prompts; rank 0
    finalizes."""
    import torch

    from megatron_osprey.data.extract import contiguous_slice
    from megatron_osprey.data.hidden_state_store import finalize_store
    from megatron_osprey.models.target.megatron_decoding import MegatronTargetModel
    from megatron_osprey.parallel import waiting_window
    from megatron_osprey.parallel.replicas import decoding_replica
    from megatron_osprey.speculative.rollout import megatron_target_states

    aux_ids, output = list(drafter.config.aux_layer_ids), Path(config.output)
    replica = decoding_replica()
    if state.rank == 0:
        claim_store(config, replicas=replica.count)
    torch.distributed.barrier()
    drafter = drafter.to(state.device)
    target = MegatronTargetModel.load(
        config.target,
        state.config,
        state.device,
        aux_ids,
        params_dtype=getattr(torch, config.dtype),
        transformer_impl=config.transformer_impl,
        sync_group=replica.sync_group,
        arch=arch,
    )
    prompts = prompts_of()
    mine = [prompts[i] for i in contiguous_slice(len(prompts), replica.index, replica.count)]
    writer = None
    if replica.is_writer:
        writer = _open_writer(config, output, arch, aux_ids, replica.index, replica.count)
    # Every rank of a replica skips the prompts its writer has stored (a resumed run).
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, writer.completed_sample_ids() if writer is not None else None)
    stored = gathered[replica.ranks[0]]
    states = lambda ids: megatron_target_states(target, ids, arch.num_layers - 1)  # noqa: E731
    with waiting_window(config.replica_timeout_minutes):  # replicas finish their slices at their own pace
        with writer if writer is not None else contextlib.nullcontext():  # an error abandons its partial shard
            results = _roll_out(config, target, states, drafter, mine, writer, stored)
    target.capture.remove()
    if state.rank == 0:
        finalize_store(output)
    torch.distributed.barrier()
    return results, output


def run(config: RolloutConfig, invocation: Invocation = Invocation("rollout")):
    """Roll out every prompt (this rank's share under torchrun) and write the finalized rollout store; returns
    this rank's RolloutRun."""
    from transformers import AutoTokenizer

    from megatron_osprey.base.arch import ModelArch
    from megatron_osprey.eval.prompts import load_prompts

    config.validate()
    rank0 = is_rank0()
    inputs = (
        check_inputs({"target": config.target, "drafter": config.drafter, "conversations": config.data_path})
        if rank0
        else {}
    )
    arch = ModelArch.from_hf_config(config.target)
    tokenizer = AutoTokenizer.from_pretrained(config.target)

    def prompts_of():
        return load_prompts(config.data_path, tokenizer, config.limit, config.enable_thinking, config.prompt_messages)

    results, output = _roll_out_job(config, arch, prompts_of)
    if rank0:
        invocation.record(output, config, inputs, {"store": output / "manifest.json"})
    return results


def main(argv: list[str] | None = None, recipes=None) -> int:
    """Parse the flags, roll out, print a summary; returns the exit code (2: bad input, one line)."""
    config, invocation = parse_config(argv, "rollout", RolloutConfig, FLAGS, __doc__, recipes)

    def roll_and_report() -> None:
        from megatron_osprey.speculative import acceptance_summary

        done = run(config, invocation)
        if not is_rank0():  # under torchrun: rank 0's share
            return
        resumed = f" ({done.skipped} stored by an earlier run)" if done.skipped else ""
        if not done.results:
            print(f"rollout: nothing to roll out{resumed} -> {config.output}")
            return
        summary = acceptance_summary(done.results)
        print(
            f"rollout: {summary['requests']} prompts{resumed}, {summary['verify_count']} verify rounds and "
            f"{sum(done.replays)} replays stored, mean acceptance length "
            f"{summary['mean_acceptance_length']:.2f} -> {config.output}"
        )

    return exit_code(roll_and_report)


if __name__ == "__main__":
    # Deprecated for one release: hands over to the job door (`python -m megatron_osprey rollout`) by exec,
    # so the job never imports this file twice; the recipe registry above the stages is the door's to import.
    from megatron_osprey.stages.cli import deprecated_module_door

    deprecated_module_door("rollout")
