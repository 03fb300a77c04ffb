"""Export a drafter checkpoint for serving.

    python -m megatron_osprey export --checkpoint CKPT --format sglang|hf|speculators|vllm --output DIR [--overwrite]

CKPT: a Megatron drafter checkpoint (Stage 3 OUT/megatron, a Stage 4 save directory), a Stage 3 OUT directory,
or a reference drafter directory (OUT/hf). Everything comes from the checkpoint's run_config.yaml /
config.json; nothing is fetched.

  sglang       Osprey and multi-layer EAGLE-3 -> OspreyQwen3ForCausalLMEagle3 / OspreyLlamaForCausalLMEagle3,
               names only the plugin registers (serve with
               SGLANG_EXTERNAL_MODEL_PACKAGE=megatron_osprey.export.sglang_plugin, sglang==0.5.23);
               one-layer EAGLE-3 -> stock SGLang LlamaForCausalLMEagle3 (midlayer.*), no plugin.
  hf           the reference drafter layout (ReferenceDrafter.from_pretrained reads it).
  speculators  vLLM speculators Eagle3Speculator (one-layer Llama EAGLE-3 only).
  vllm         vLLM 0.32 (--speculative-config '{"method": "eagle3", "model": DIR, ...}'): EAGLE-3 with plain
               extra layers -> stock LlamaForCausalLMEagle3; Osprey, fused multi-layer EAGLE-3 and q/k-norm
               bodies -> Eagle3OspreyLlamaForCausalLM / Eagle3OspreyQwen3ForCausalLM, which this package's
               vLLM plugin registers (installed into vLLM's environment by `osprey engine install vllm`).
               Aux taps are written in vLLM's count (this project's layer id + 1). Refused, naming the field,
               when vLLM cannot serve the drafter for the run's target (tap count, last-layer tap,
               vocab_size, target_hidden_size).

Trust: a Megatron checkpoint is torch distributed-checkpoint data, which torch unpickles. Its .metadata is
checked against an allow-list first, but load only checkpoints you trust. The exports written here
(safetensors + JSON) hold no code: they are the form to share. The writers are export/.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from megatron_osprey.config.flags import STORE_TRUE, Flag, skip_checksum_flag
from megatron_osprey.export.config import ARCHITECTURE_NAMES, FORMATS
from megatron_osprey.stages.cli import Invocation, check_inputs, exit_code, parse_config


@dataclasses.dataclass
class ExportConfig:
    """Export settings (the flags of the same names)."""

    checkpoint: str | None = None
    format: str = "sglang"
    output: str | None = None
    overwrite: bool = False
    # sglang config architectures: this project's plugin (osprey) or the names Osprey's patched SGLang registers
    architecture_names: str = "osprey"
    skip_checksum: bool = False  # load a Megatron --checkpoint without checking its files against checksums.json


FLAGS = {
    "export": [
        Flag("--checkpoint", "checkpoint", {"help": "a drafter checkpoint (Stage 3 or Stage 4 output)"}),
        Flag("--format", "format", {"choices": list(FORMATS)}),
        Flag("--output", "output", {}),
        Flag("--overwrite", "overwrite", {**STORE_TRUE, "help": "replace a non-empty --output"}),
        skip_checksum_flag("a Megatron --checkpoint"),
        Flag(
            "--architecture-names",
            "architecture_names",
            {
                "choices": list(ARCHITECTURE_NAMES),
                "help": "sglang config architectures: this project's plugin (osprey) or Osprey's patched SGLang "
                "(release)",
            },
        ),
    ]
}


def run(config: ExportConfig, invocation: Invocation = Invocation("export")) -> Path:
    """Load any drafter checkpoint (Megatron, Stage 3 output, reference dir) and export it."""
    from megatron_osprey.base.checksums import skipped_checksum_note
    from megatron_osprey.base.outputs import claimed_output
    from megatron_osprey.eval.loading import load_drafter
    from megatron_osprey.export.formats import export_drafter

    for flag, value in (("--checkpoint", config.checkpoint), ("--output", config.output)):
        if not value:
            raise ValueError(f"{flag} is required.")
    if config.format not in FORMATS:
        raise ValueError(f"--format must be one of {FORMATS}, got {config.format!r}.")
    # Refused before the drafter loads; emptied only when it holds this stage's own earlier (or partial) export. The
    # marker written first and provenance.json written last make an export stopped midway a partial one to evaluate.
    with claimed_output(config.output, {"--checkpoint": config.checkpoint}, config.overwrite, stage="export") as output:
        # Names --checkpoint when it is not a drafter; a Megatron one is checked against its checksums.json.
        loaded = load_drafter(config.checkpoint, "--checkpoint", verify=not config.skip_checksum)
        if config.skip_checksum and loaded.source == "megatron":
            print(skipped_checksum_note(config.checkpoint), file=sys.stderr, flush=True)
        inputs = check_inputs({"checkpoint": config.checkpoint})  # before anything is written
        target = loaded.run_config.get("target")
        tokenizer_dir = Path(target) if target and Path(target).is_dir() else None
        written = export_drafter(
            loaded.drafter,
            config.format,
            output,
            loaded.run_config,
            tokenizer_dir=tokenizer_dir,
            architecture_names=config.architecture_names,
        )
        invocation.record(written, config, inputs, {"export": written})
    return written


def main(argv: list[str] | None = None, recipes=None) -> int:
    """Parse the flags, export, print where; returns the exit code (2: bad input, one line)."""
    config, invocation = parse_config(argv, "export", ExportConfig, FLAGS, __doc__, recipes)

    def export_and_report() -> None:
        out = run(config, invocation)
        print(f"exported {config.checkpoint} as {config.format} -> {out}")

    return exit_code(export_and_report)


if __name__ == "__main__":
    # Deprecated for one release: hands over to the job door (`python -m megatron_osprey export`) by exec,
    # so the job never imports this file twice; the recipe registry above the stages is the door's to import.
    from megatron_osprey.stages.cli import deprecated_module_door

    deprecated_module_door("export")
