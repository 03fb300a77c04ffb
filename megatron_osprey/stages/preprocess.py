"""Tokenize text documents into a Megatron indexed dataset (PREFIX_<key>_document.bin/.idx) for Stage 2.

    python -m megatron_osprey.stages.preprocess --input data.jsonl.zst --json-key text \\
        --tokenizer TOKENIZER_DIR --output-prefix out/fineweb --workers 16 [--partitions 8]

Input: JSONL (plain, .gz or .zst), Parquet, or a `datasets` save_to_disk directory. The pipeline is
data/preprocess.py; provenance.json is written beside the output prefix.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import warnings
from pathlib import Path

from megatron_osprey.config.flags import STORE_TRUE, Flag
from megatron_osprey.stages.cli import Invocation, check_inputs, exit_code, parse_config


def default_workers() -> int:
    """One encoding process per core, leaving one for the reader."""
    return max(1, (os.cpu_count() or 2) - 1)


@dataclasses.dataclass
class PreprocessConfig:
    """Preprocessing settings (flag names match the field names)."""

    input: str | None = None
    # A file listing inputs, one per line: array task i (SLURM_ARRAY_TASK_ID) tokenizes line i into
    # PREFIX_0000i; outside an array every line in turn.
    input_list: str | None = None
    tokenizer: str | None = None
    output_prefix: str | None = None
    json_key: str = "text"
    workers: int = dataclasses.field(default_factory=default_workers)
    partitions: int = 1
    strict: bool = False
    overwrite: bool = False
    split: str = "train"
    eod_token: str | None = None
    add_special_tokens: bool = True
    keep_partitions: bool = False
    batch_bytes: int = 1 << 20
    max_reported_problems: int = 10
    progress: bool = True

    def output_path(self, index: int | None = None) -> str:
        """The indexed dataset's prefix (Stage 2's --data-path): PREFIX_<key>_document, or for line `index` of
        an input list PREFIX_0000i_<key>_document."""
        prefix = self.output_prefix if index is None else f"{self.output_prefix}_{index:05d}"
        return f"{prefix}_{self.json_key}_document"

    def jobs(self, environ) -> list[tuple[str, int | None]]:
        """(input, list index) pairs this process tokenizes: the input, or its array task's line of the list."""
        if not self.input_list:
            return [(self.input, None)]
        lines = [line.strip() for line in Path(self.input_list).read_text().splitlines() if line.strip()]
        if "SLURM_ARRAY_TASK_ID" not in environ:
            return [(line, i) for i, line in enumerate(lines)]
        index = int(environ["SLURM_ARRAY_TASK_ID"]) - int(environ.get("SLURM_ARRAY_TASK_MIN", "0"))
        if not 0 <= index < len(lines):
            raise ValueError(f"--input-list {self.input_list} has no line {index + 1} for array task {index}.")
        return [(lines[index], index)]


def _megabytes(text: str) -> int:
    value = float(text)
    if not value > 0:
        raise ValueError("must be positive")
    return int(value * (1 << 20))


FLAGS = {
    "preprocess": [
        Flag(
            "--input",
            "input",
            {"help": "JSONL (plain, .gz or .zst), Parquet, a datasets save_to_disk directory, or a Hub dataset name"},
        ),
        Flag("--input-list", "input_list", {"help": "a file of inputs, one per line (a Slurm array: one per task)"}),
        Flag("--json-key", "json_key", {"help": "JSON key / column holding the document text"}),
        Flag("--split", "split", {"help": "split to read from a datasets input"}),
        Flag(
            "--tokenizer", "tokenizer", {"help": "HF fast-tokenizer directory (with tokenizer.json) or tokenizer.json"}
        ),
        Flag("--eod-token", "eod_token", {"help": "end-of-document token (default: the tokenizer's eos_token)"}),
        Flag(
            "--no-special-tokens",
            "add_special_tokens",
            {"action": "store_false", "help": "do not add the tokenizer's own special tokens (e.g. BOS) to documents"},
        ),
        Flag("--output-prefix", "output_prefix", {"help": "writes PREFIX_<json-key>_document.bin/.idx"}),
        Flag("--workers", "workers", {"type": int, "help": "encoding processes, one core each (default: CPUs - 1)"}),
        Flag("--partitions", "partitions", {"type": int, "help": "split the input into N resumable partitions"}),
        Flag("--keep-partitions", "keep_partitions", {**STORE_TRUE, "help": "keep partition files after merging"}),
        Flag("--strict", "strict", {**STORE_TRUE, "help": "fail on the first malformed or empty record"}),
        Flag("--overwrite", "overwrite", {**STORE_TRUE, "help": "replace an existing output"}),
        Flag("--batch-mb", "batch_bytes", {"type": _megabytes, "metavar": "MB", "help": "input MB per worker task"}),
        Flag("--no-progress", "progress", {"action": "store_false", "help": "hide the progress bar"}),
    ],
}


def run(config: PreprocessConfig, invocation: Invocation = Invocation("preprocess")) -> list:
    """Tokenize the input (or this array task's line of the input list); returns the PreprocessResults."""
    from megatron_osprey.data.preprocess import preprocess

    if bool(config.input) == bool(config.input_list):
        raise ValueError("pass exactly one of --input or --input-list.")
    for flag, value in (("--tokenizer", config.tokenizer), ("--output-prefix", config.output_prefix)):
        if not value:
            raise ValueError(f"{flag} is required.")
    results = []
    for source, index in config.jobs(os.environ):
        job = dataclasses.replace(config, input=source, input_list=None)
        job.output_prefix = str(Path(config.output_path(index)).with_name(Path(config.output_path(index)).name))
        job.output_prefix = config.output_prefix if index is None else f"{config.output_prefix}_{index:05d}"
        inputs = check_inputs({"input": source if Path(source).exists() else None, "tokenizer": config.tokenizer})
        results.append(preprocess(job))
        prefix = job.output_path()
        outputs = {"bin": f"{prefix}.bin", "idx": f"{prefix}.idx"}
        invocation.record(Path(prefix).parent, config, inputs, outputs)
    return results


def main(argv: list[str] | None = None, recipes=None) -> int:
    """Parse the flags, tokenize; returns the exit code (2: bad input or nothing usable, one line)."""
    # megatron.core's package import warns about training-only extras (TE, apex) that tokenization never uses.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core\..*")
    config, invocation = parse_config(argv, "preprocess", PreprocessConfig, FLAGS, __doc__, recipes)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)

    def tokenize() -> None:
        run(config, invocation)

    return exit_code(tokenize, also=(KeyError, ImportError))


if __name__ == "__main__":
    # The job door; the recipe registry builds this module's config, so only the program imports it.
    from megatron_osprey.recipes import run_stage

    sys.exit(run_stage("preprocess", sys.argv[1:]))
