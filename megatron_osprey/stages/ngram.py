"""N-gram drafter: count a corpus with the target's tokenizer; keep each context's most frequent continuation.

    python -m megatron_osprey ngram --input CORPUS.jsonl [--input ...] --tokenizer TARGET_DIR --order 4 \\
        --output DIR [--min-count 1] [--json-key text] [--corpus-kind auto|text|conversations] [--limit N]

CORPUS: text JSONL (one string under --json-key per row) or conversations JSONL, whose assistant turns are
counted as the target writes them (rendered through its chat template; their contexts may reach into the
prompt). Writes DIR/ngram.npz (hashed contexts of 1..order-1 tokens, sorted, with the next id and counts),
DIR/config.json (tagged megatron_osprey.ngram_drafter/1: order, tokenizer, vocabulary) and
DIR/provenance.json (last: a DIR the stage stopped writing is partial, and evaluate refuses it). The evaluate
stage takes DIR as a drafter (`--drafter NAME=DIR`, chains only). The counting is speculative/ngram.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_osprey.base.outputs import check_output, claimed_output
from megatron_osprey.base.provenance import PROVENANCE_FILE
from megatron_osprey.config.flags import STORE_TRUE, Flag, boolean
from megatron_osprey.stages.cli import Invocation, check_inputs, exit_code, parse_config


@dataclasses.dataclass
class NgramConfig:
    """N-gram drafter settings (the flags of the same names)."""

    inputs: list[str] = dataclasses.field(default_factory=list)
    tokenizer: str | None = None  # the target's HF directory (its tokenizer and chat template)
    order: int = 4  # contexts of up to order - 1 tokens
    output: str | None = None
    min_count: int = 1  # drop contexts whose best continuation was seen fewer times
    json_key: str = "text"
    corpus_kind: str = "auto"
    enable_thinking: bool | None = None
    limit: int | None = None  # rows per input file
    progress: bool = True
    overwrite: bool = False

    def validate(self) -> None:
        """Flags and paths, before any file is read."""
        for flag, value in (("--input", self.inputs), ("--tokenizer", self.tokenizer), ("--output", self.output)):
            if not value:
                raise ValueError(f"{flag} is required.")
        if self.order < 2:
            raise ValueError(f"--order must be >= 2, got {self.order}.")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}.")
        if not Path(self.tokenizer).is_dir():
            raise FileNotFoundError(f"--tokenizer {self.tokenizer}: no such directory (the target's HF directory).")
        check_output(self.output, self.paths_read(), PROVENANCE_FILE, self.overwrite, stage="ngram")

    def paths_read(self) -> dict[str, str | None]:
        """Every path the stage reads, by the flag that names it (the output may not overlap any)."""
        return {f"--input {path}": path for path in self.inputs} | {"--tokenizer": self.tokenizer}


FLAGS = {
    "ngram": [
        Flag("--input", "inputs", {"action": "append", "help": "text or conversations JSONL, repeatable"}),
        Flag("--tokenizer", "tokenizer", {"help": "the target's HF directory (tokenizer + chat template)"}),
        Flag("--order", "order", {"type": int, "help": "n: contexts of up to n - 1 tokens (default 4)"}),
        Flag("--output", "output", {}),
        Flag("--min-count", "min_count", {"type": int, "help": "keep contexts whose continuation was seen this often"}),
        Flag("--json-key", "json_key", {"help": "the text field of a text JSONL (default text)"}),
        Flag("--corpus-kind", "corpus_kind", {"help": "auto (default: from the first row), text or conversations"}),
        Flag("--enable-thinking", "enable_thinking", {"type": boolean, "metavar": "true|false"}),
        Flag("--limit", "limit", {"type": int, "help": "only the first N rows of each input"}),
        Flag("--no-progress", "progress", {"action": "store_false"}),
        Flag("--overwrite", "overwrite", {**STORE_TRUE, "help": "replace this stage's earlier output in --output"}),
    ]
}


def run(config: NgramConfig, invocation: Invocation = Invocation("ngram")):
    """Count the corpora and write the drafter; returns it."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from megatron_osprey.speculative.ngram import CONFIG_NAME, TABLES_NAME
    from megatron_osprey.speculative.ngram_corpus import CorpusOptions, build_ngram_drafter

    config.validate()
    inputs = check_inputs({f"corpus:{i}": p for i, p in enumerate(config.inputs)} | {"tokenizer": config.tokenizer})
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
    options = CorpusOptions(config.corpus_kind, config.json_key, config.enable_thinking, config.limit)
    with tqdm(desc="ngram", unit="seq", disable=not config.progress) as progress:
        drafter = build_ngram_drafter(
            config.inputs, tokenizer, config.order, options, config.min_count, str(config.tokenizer), progress
        )
    # The marker first and provenance.json last: a table stopped midway reads as partial to evaluate.
    with claimed_output(config.output, config.paths_read(), config.overwrite, stage="ngram") as output:
        drafter.save(output)
        invocation.record(output, config, inputs, {"tables": output / TABLES_NAME, "config": output / CONFIG_NAME})
    return drafter


def main(argv: list[str] | None = None, recipes=None) -> int:
    """Parse the flags, build the drafter, print a summary; returns the exit code (2: bad input, one line)."""
    config, invocation = parse_config(argv, "ngram", NgramConfig, FLAGS, __doc__, recipes)

    def build_and_report() -> None:
        drafter = run(config, invocation)
        contexts = ", ".join(f"{k}: {t.keys.size:,}" for k, t in enumerate(drafter.tables, start=1))
        print(
            f"n-gram drafter of order {drafter.order} from {drafter.metadata['counted_tokens']:,} tokens "
            f"-> {config.output} (contexts by length: {contexts})"
        )

    return exit_code(build_and_report)


if __name__ == "__main__":
    # Deprecated for one release: hands over to the job door (`python -m megatron_osprey ngram`) by exec,
    # so the job never imports this file twice; the recipe registry above the stages is the door's to import.
    from megatron_osprey.stages.cli import deprecated_module_door

    deprecated_module_door("ngram")
