"""Tokenize text documents into a Megatron indexed dataset (PREFIX_<key>_document.bin/.idx) for Stage 2.

    python -m megatron_osprey preprocess --input data.jsonl.zst --json-key text \\
        --tokenizer TOKENIZER_DIR --output-prefix out/fineweb --workers 16 [--partitions 8]

Input: JSONL (plain, .gz or .zst), Parquet, a `datasets` save_to_disk directory, or a directory of such
files (shards, e.g. FineWeb's sample/100BT/*.parquet as the Hub stores it); --input-list names inputs one per
line. Shards and list lines are tokenized each into DIR/0000i/NAME_<key>_document (PREFIX = DIR/NAME; i: its
place in the sorted listing or the list). Every output prefix gets its own record, OUTPUT.provenance.json beside
its .bin and .idx, so prefixes sharing a directory stay checked each. A Slurm array task takes every N-th of
them (N: SLURM_ARRAY_TASK_COUNT), so any number of tasks covers any number of shards. Stage 2 reads them all as
one blend (`--data-path P0 P1 ...`, weighted by token count). The pipeline is data/preprocess.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from pathlib import Path

from megatron_osprey.base.redact import configure_redacted_logging
from megatron_osprey.config.flags import STORE_TRUE, Flag
from megatron_osprey.stages.cli import Invocation, check_inputs, exit_code, parse_config


def default_workers() -> int:
    """One encoding process per core, leaving one for the reader."""
    return max(1, (os.cpu_count() or 2) - 1)


@dataclasses.dataclass
class PreprocessConfig:
    """Preprocessing settings (flag names match the field names)."""

    input: str | None = None  # a file, a save_to_disk directory, or a directory of shard files
    # A file listing inputs, one per line, each tokenized into DIR/0000i/NAME (i: its line); array task k of N
    # takes lines k, k + N, ...; outside an array every line in turn.
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
        """The indexed dataset's prefix (Stage 2's --data-path): PREFIX_<key>_document, or for shard / list line
        `index` DIR/0000i/NAME_<key>_document (PREFIX = DIR/NAME), in a directory of its own so that its
        provenance.json is its own."""
        return f"{self.job_prefix(index)}_{self.json_key}_document"

    def job_prefix(self, index: int | None) -> str:
        """The --output-prefix of one job: PREFIX, or DIR/0000i/NAME for shard / list line `index`."""
        if index is None:
            return self.output_prefix
        prefix = Path(self.output_prefix)
        return str(prefix.parent / f"{index:05d}" / prefix.name)

    def sources(self) -> list[str] | None:
        """The inputs tokenized each into its own indexed prefix (list lines, or a directory's shard files in
        sorted order); None for one input."""
        if self.input_list:
            lines = [line.strip() for line in Path(self.input_list).read_text().splitlines() if line.strip()]
            if not lines:
                raise ValueError(f"--input-list {self.input_list} names no input.")
            return lines
        return shard_files(self.input) if self.input else None

    def output_paths(self) -> list[str]:
        """Every indexed prefix the run writes (Stage 2's --data-path): one, or one per shard / list line."""
        sources = self.sources()
        return [self.output_path()] if sources is None else [self.output_path(i) for i in range(len(sources))]

    def jobs(self, environ) -> list[tuple[str, int | None]]:
        """(input, index) pairs this process tokenizes: the one input (array task 0 only), or its array task's
        share of the shards / list lines (every N-th, N the array's task count); outside an array, all."""
        sources = self.sources()
        task, count = array_task(environ)
        if sources is None:
            return [(self.input, None)] if task == 0 else []
        return [(source, i) for i, source in enumerate(sources) if i % count == task]


def array_task(environ) -> tuple[int, int]:
    """(this task's offset, the task count) of a Slurm array (0, 1 outside one). Only a whole array of
    consecutive ids can share the shards: a resubmission of some of its tasks is refused (resubmit the whole
    array instead; finished shards are skipped)."""
    if "SLURM_ARRAY_TASK_ID" not in environ:
        return 0, 1
    try:
        first, count = int(environ["SLURM_ARRAY_TASK_MIN"]), int(environ["SLURM_ARRAY_TASK_COUNT"])
        last, step = int(environ["SLURM_ARRAY_TASK_MAX"]), int(environ.get("SLURM_ARRAY_TASK_STEP", "1"))
    except (KeyError, ValueError) as err:
        raise ValueError(f"a Slurm array task without its array's bounds ({err}); run preprocess as sbatch --array.")
    task = int(environ["SLURM_ARRAY_TASK_ID"]) - first
    if step != 1 or last - first + 1 != count or not 0 <= task < count:
        raise ValueError(
            f"Slurm array {first}-{last} (step {step}, {count} tasks) is not one run of consecutive task ids, so its "
            "tasks cannot share the shards; resubmit the whole array (shards finished earlier are skipped)."
        )
    return task, count


SHARD_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.zstd", ".json.gz", ".zst", ".zstd")


def shard_files(path: str) -> list[str] | None:
    """A directory's shard files (sorted by name), when it is a directory of shards rather than a `datasets`
    save_to_disk directory or a file; None otherwise. A directory holding no shard file is refused."""
    from megatron_osprey.data.user_data import is_saved_dataset

    directory = Path(path)
    if not directory.is_dir() or is_saved_dataset(directory):
        return None
    files = sorted(str(f) for f in directory.iterdir() if f.is_file() and f.name.endswith(SHARD_SUFFIXES))
    if not files:
        raise ValueError(
            f"--input {path} is a directory without shard files ({', '.join(SHARD_SUFFIXES)}) and is not a "
            "`datasets` save_to_disk directory."
        )
    return files


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
            {"help": "JSONL (.gz, .zst), Parquet, a save_to_disk directory, a directory of shards, or a Hub name"},
        ),
        Flag(
            "--input-list",
            "input_list",
            {"help": "a file of inputs, one per line (a Slurm array task takes every N-th)"},
        ),
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
    jobs = config.jobs(os.environ)
    if not jobs:
        print(f"array task {os.environ.get('SLURM_ARRAY_TASK_ID')}: no input of its share; nothing to do.")
    for source, index in jobs:
        job = dataclasses.replace(config, input=source, input_list=None)
        job.output_prefix = config.job_prefix(index)
        if index is not None and not config.overwrite and shard_done(job.output_path(), source, config.tokenizer):
            print(f"{source}: tokenized into {job.output_path()} in an earlier run, skipped")
            continue
        inputs = check_inputs({"input": source if Path(source).exists() else None, "tokenizer": config.tokenizer})
        results.append(preprocess(job))
        prefix = job.output_path()
        outputs = {"bin": f"{prefix}.bin", "idx": f"{prefix}.idx"}
        # PREFIX.provenance.json: several prefixes may share a directory (one record each, each checked).
        invocation.record_file(prefix, job, inputs, outputs)
    return results


def shard_done(prefix: str, source: str, tokenizer: str) -> bool:
    """Whether an earlier run tokenized `source` into `prefix` completely: the provenance.json beside it records
    this input and tokenizer with the bytes they have now, and the .bin and .idx with theirs (a requeued array
    task goes on from there; a shard or tokenizer changed since is tokenized again)."""
    from megatron_osprey.base.provenance import file_record, records_unchanged

    outputs = {"bin": f"{prefix}.bin", "idx": f"{prefix}.idx"}
    record = file_record(prefix)
    return records_unchanged(record.parent, {"input": source, "tokenizer": tokenizer}, outputs, record.name)


def main(argv: list[str] | None = None, recipes=None) -> int:
    """Parse the flags, tokenize; returns the exit code (2: bad input or nothing usable, one line)."""
    # megatron.core's package import warns about training-only extras (TE, apex) that tokenization never uses.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core\..*")
    config, invocation = parse_config(argv, "preprocess", PreprocessConfig, FLAGS, __doc__, recipes)
    configure_redacted_logging(logging.INFO)  # a dataset URL may carry a token

    def tokenize() -> None:
        run(config, invocation)

    return exit_code(tokenize, also=(KeyError, ImportError))


if __name__ == "__main__":
    # Deprecated for one release: hands over to the job door (`python -m megatron_osprey preprocess`) by exec,
    # so the job never imports this file twice; the recipe registry above the stages is the door's to import.
    from megatron_osprey.stages.cli import deprecated_module_door

    deprecated_module_door("preprocess")
