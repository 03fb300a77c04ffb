"""The preprocessing pair of `make bench`: ours, Megatron-LM's pipeline, and the tokenizer's own limit.

The peer is a re-implementation after Megatron-LM's `tools/preprocess_data.py` at tag core_v0.16.1 (the tag of
megatron-core 0.16.1, installed here): a `multiprocessing.Pool` whose initializer loads the tokenizer in every
worker, `pool.imap` of one JSON line per task in chunks of 32, per document the HF tokenizer's ids plus the
end-of-document token, appended in input order to megatron-core's `IndexedDatasetBuilder` with the dtype
`DType.optimal_dtype(vocab size)`. Sentence splitting and partitions are off, as in its default run.

Ours runs as a user runs it (`tools/preprocess_data.py`, a subprocess); so does the peer (this file with
`--megatron-peer`), so both pay their start-up. The limit is the Rust tokenizer's `encode_batch` over the same
texts on 2 threads, in this process with the tokenizer already loaded: the tokenization alone.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CHUNK_SIZE = 32  # Megatron-LM's pool.imap chunk size


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """A JSONL of the demo's pretraining documents (all five domains), repeated up to ~megabytes; returns its docs."""
    from megatron_osprey.demo.corpora import DOMAINS, pretraining_text

    docs = pretraining_text(DOMAINS, 400_000, seed=seed)
    budget, written, count = int(megabytes * 1e6), 0, 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        while written < budget:
            for doc in docs:
                line = json.dumps({"text": doc}) + "\n"
                handle.write(line)
                written, count = written + len(line.encode("utf-8")), count + 1
                if written >= budget:
                    break
    return count


# --- the peer: Megatron-LM's pipeline, re-implemented -----------------------------------------------------------


class _MegatronStyleEncoder:
    """Megatron-LM's Encoder: the tokenizer lives on the class, loaded once per pool worker by the initializer."""

    tokenizer = None

    def __init__(self, tokenizer_dir: str) -> None:
        self.tokenizer_dir = tokenizer_dir

    def initializer(self) -> None:
        from transformers import AutoTokenizer

        _MegatronStyleEncoder.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)

    def encode(self, json_line: str):
        text = json.loads(json_line)["text"]
        tok = _MegatronStyleEncoder.tokenizer
        ids = tok(text).input_ids
        lens = [len(ids)] if ids else []
        if ids:  # --append-eod
            ids.append(tok.eos_token_id)
            lens[-1] += 1
        return ids, lens, len(json_line)


def megatron_style_preprocess(input_path: str, tokenizer_dir: str, output_prefix: str, workers: int) -> str:
    """Tokenize input_path the way Megatron-LM's tools/preprocess_data.py does; returns the dataset prefix."""
    from megatron.core.datasets import indexed_dataset
    from transformers import AutoTokenizer

    encoder = _MegatronStyleEncoder(tokenizer_dir)
    vocab_size = AutoTokenizer.from_pretrained(tokenizer_dir).vocab_size
    prefix = f"{output_prefix}_text_document"
    with open(input_path, encoding="utf-8") as fin:
        pool = multiprocessing.Pool(workers, initializer=encoder.initializer)
        builder = indexed_dataset.IndexedDatasetBuilder(
            prefix + ".bin", dtype=indexed_dataset.DType.optimal_dtype(vocab_size)
        )
        for ids, lens, _ in pool.imap(encoder.encode, fin, CHUNK_SIZE):
            builder.add_document(ids, lens)
        builder.finalize(prefix + ".idx")
        pool.close()
        pool.join()
    return prefix


# --- the pair ---------------------------------------------------------------------------------------------------


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")


def _run(cmd: list, log: Path) -> None:
    with open(log, "w") as handle:
        proc = subprocess.run([sys.executable, *map(str, cmd)], env=_env(), stdout=handle, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed (exit {proc.returncode}); see {log}.")


def ours_command(corpus: Path, tokenizer: Path, prefix: Path, workers: int) -> list:
    return [
        REPO / "tools" / "preprocess_data.py",
        "--input",
        corpus,
        "--tokenizer",
        tokenizer,
        "--output-prefix",
        prefix,
        "--workers",
        workers,
        "--no-progress",
        "--overwrite",
    ]


def peer_command(corpus: Path, tokenizer: Path, prefix: Path, workers: int) -> list:
    return [Path(__file__), "--megatron-peer", corpus, tokenizer, prefix, workers]


def check_identical(ours_prefix: str, peer_prefix: str) -> None:
    """Raise unless the two datasets' .bin (and .idx) files are byte-identical."""
    for ext in (".bin", ".idx"):
        a, b = Path(ours_prefix + ext), Path(peer_prefix + ext)
        if a.read_bytes() != b.read_bytes():
            raise AssertionError(f"preprocessing: {a} and {b} differ; ours and the peer must write the same bytes.")


def encode_batch_limit(corpus: Path, tokenizer: Path, threads: int = 2):
    """The limit: a callable running the Rust tokenizer's encode_batch over the corpus texts on `threads` threads."""
    from tokenizers import Tokenizer

    os.environ["RAYON_NUM_THREADS"] = str(threads)  # read when the Rust thread pool first starts
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    rust = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json"))
    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    return lambda: sum(len(e.ids) for e in rust.encode_batch(texts, add_special_tokens=True))


def preprocess_pair(workdir: Path, tokenizer: Path, megabytes: float, workers: int = 2):
    """The preprocessing Pair over a fresh corpus of ~megabytes in workdir."""
    from benchmarks.bench_harness import Pair

    workdir.mkdir(parents=True, exist_ok=True)
    corpus = workdir / "corpus.jsonl"
    write_corpus(corpus, megabytes)
    ours_prefix, peer_prefix = workdir / "ours", workdir / "megatron"

    def ours():
        _run(ours_command(corpus, tokenizer, ours_prefix, workers), workdir / "ours.log")
        return f"{ours_prefix}_text_document"

    def peer():
        _run(peer_command(corpus, tokenizer, peer_prefix, workers), workdir / "megatron.log")
        return f"{peer_prefix}_text_document"

    return Pair(
        stage=f"preprocessing ({corpus.stat().st_size / 1e6:.1f} MB, {workers} workers)",
        ours=ours,
        peer=peer,
        limit=encode_batch_limit(corpus, tokenizer, threads=workers),
        peer_name="a re-implementation after Megatron-LM's tools/preprocess_data.py (tag core_v0.16.1): "
        "multiprocessing.Pool, per-document HF tokenizer encodes, imap chunk 32, megatron-core's IndexedDatasetBuilder",
        limit_name=f"the Rust tokenizer's encode_batch on {workers} threads over the same texts",
        check=check_identical,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-peer", nargs=4, metavar=("INPUT", "TOKENIZER", "PREFIX", "WORKERS"), required=True)
    args = parser.parse_args(argv)
    corpus, tokenizer, prefix, workers = args.megatron_peer
    megatron_style_preprocess(corpus, tokenizer, prefix, int(workers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
