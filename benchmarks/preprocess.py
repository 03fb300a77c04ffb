"""Throughput of tools/preprocess_data.py (tokens/s, docs/s, MB/s), optionally against Megatron-LM's.

Usage:
  # build a ~20 MB JSONL of real text (this Python's stdlib sources) and a 32k byte-level BPE
  python benchmarks/preprocess.py --make-corpus /tmp/bench/corpus.jsonl --corpus-mb 20 \
      --train-tokenizer /tmp/bench/tok32k --vocab-size 32000
  # measure ours (and Megatron-LM's, with the same tokenizer and worker count)
  python benchmarks/preprocess.py --input /tmp/bench/corpus.jsonl --tokenizer /tmp/bench/tok32k \
      --workers 2 [--megatron-lm /path/to/Megatron-LM [--megatron-pythonpath EXTRA_DIR]]

Each tool runs as a subprocess, as a user runs it. Two times are reported per
tool: end to end (process start to exit) and processing only, which subtracts
the same tool's time on an empty input (imports, tokenizer load, worker start).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parent.parent
EOS = "<|endoftext|>"


def make_corpus(out: Path, megabytes: float, doc_chars: int = 3000) -> int:
    """Write a JSONL of ~`megabytes` of stdlib Python source, cut into ~doc_chars documents."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    budget, written, docs = int(megabytes * 1e6), 0, 0
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            # Documents of about doc_chars, cut at blank lines like web-page paragraphs.
            chunk: List[str] = []
            size = 0
            for para in text.split("\n\n"):
                chunk.append(para)
                size += len(para) + 2
                if size >= doc_chars:
                    line = json.dumps({"text": "\n\n".join(chunk)}) + "\n"
                    f.write(line)
                    written += len(line.encode("utf-8"))
                    docs += 1
                    chunk, size = [], 0
                    if written >= budget:
                        break
            if written >= budget:
                break
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return docs


def train_tokenizer(corpus: Path, out: Path, vocab_size: int) -> None:
    """Train a byte-level BPE (GPT-2 style) on the corpus; save tokenizer.json + config."""
    from megatron_osprey.data.regenerate.tiny_target import train_byte_level_bpe

    def texts():
        with open(corpus, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]

    tok = train_byte_level_bpe(texts(), vocab_size, [EOS])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    with open(out / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "model_max_length": 1 << 30}, f)


@dataclass
class Timing:
    """One tool's run on the benchmark input."""

    name: str
    wall_s: float
    overhead_s: float
    cpu_s: float
    overhead_cpu_s: float
    tokens: int
    documents: int
    input_bytes: int

    @property
    def processing_s(self) -> float:
        """Wall time minus the same tool's time on an empty input."""
        return max(self.wall_s - self.overhead_s, 1e-9)

    @property
    def processing_cpu_s(self) -> float:
        """CPU time (all processes) minus the same tool's CPU time on an empty input."""
        return max(self.cpu_s - self.overhead_cpu_s, 1e-9)

    def line(self) -> str:
        """Both end-to-end and processing-only rates."""
        proc = self.processing_s
        return (
            f"{self.name:<12} {self.tokens / self.wall_s:>12,.0f} tok/s end-to-end "
            f"({self.wall_s:.1f} s) | processing only: {self.tokens / proc:>12,.0f} tok/s, "
            f"{self.documents / proc:,.0f} docs/s, {self.input_bytes / 1e6 / proc:.2f} MB/s "
            f"({proc:.1f} s; start-up {self.overhead_s:.1f} s) | "
            f"{self.tokens / self.processing_cpu_s:,.0f} tok per CPU-second of processing "
            f"({self.processing_cpu_s:.1f} of {self.cpu_s:.1f} CPU-s, all processes)"
        )


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _run(cmd: List[str], env: dict, log: Path) -> tuple:
    """Run a tool; return (wall seconds, CPU seconds of it and its reaped workers)."""
    cpu0, start = _cpu_children(), time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall, cpu = time.perf_counter() - start, _cpu_children() - cpu0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}); see {log}")
    return wall, cpu


def _counts(prefix: str) -> tuple:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return int(ds.sequence_lengths.sum()), len(ds)


def _env(extra_pythonpath: Optional[str] = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if extra_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [extra_pythonpath, env.get("PYTHONPATH")]))
    return env


def _ours_cmd(inp: str, tok: str, prefix: str, workers: int) -> List[str]:
    return [
        sys.executable,
        str(REPO / "tools" / "preprocess_data.py"),
        "--input",
        inp,
        "--tokenizer",
        tok,
        "--output-prefix",
        prefix,
        "--workers",
        str(workers),
        "--no-progress",
        "--overwrite",
    ]


def _megatron_cmd(mlm: str, inp: str, tok: str, prefix: str, workers: int) -> List[str]:
    return [
        sys.executable,
        os.path.join(mlm, "tools", "preprocess_data.py"),
        "--input",
        inp,
        "--output-prefix",
        prefix,
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        tok,
        "--workers",
        str(workers),
        "--append-eod",
    ]


def measure(name: str, build_cmd, inp: str, workdir: Path, env: dict, input_bytes: int, repeat: int = 1) -> Timing:
    """Time one tool on an empty input (start-up) and on the real one; the fastest of `repeat` runs."""
    runs = [_measure_once(name, build_cmd, inp, workdir, env, input_bytes) for _ in range(repeat)]
    return min(runs, key=lambda t: t.wall_s)


def _measure_once(name: str, build_cmd, inp: str, workdir: Path, env: dict, input_bytes: int) -> Timing:
    empty = workdir / "empty.jsonl"
    empty.write_text("")
    overhead, overhead_cpu = _run(
        build_cmd(str(empty), str(workdir / f"{name}_empty")), env, workdir / f"{name}_empty.log"
    )
    wall, cpu = _run(build_cmd(inp, str(workdir / name)), env, workdir / f"{name}.log")
    tokens, docs = _counts(str(workdir / f"{name}_text_document"))
    return Timing(name, wall, overhead, cpu, overhead_cpu, tokens, docs, input_bytes)


def main(argv=None) -> int:
    """Build corpus/tokenizer and/or run the comparison."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", help="JSONL with a 'text' key")
    p.add_argument("--tokenizer", help="tokenizer directory (tokenizer.json + tokenizer_config.json)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--megatron-lm", help="a Megatron-LM checkout; also runs its tools/preprocess_data.py")
    p.add_argument(
        "--megatron-pythonpath",
        default=None,
        help="extra PYTHONPATH for Megatron-LM's imports (e.g. six, triton), after the checkout",
    )
    p.add_argument("--workdir", default=None, help="where outputs and logs go (default: a temp dir)")
    p.add_argument("--repeat", type=int, default=1, help="runs per tool; the fastest is reported")
    p.add_argument("--make-corpus", type=Path, help="write a benchmark JSONL here first")
    p.add_argument("--corpus-mb", type=float, default=20.0)
    p.add_argument("--train-tokenizer", type=Path, help="train a byte-level BPE on the corpus into this dir")
    p.add_argument("--vocab-size", type=int, default=32000)
    a = p.parse_args(argv)

    if a.make_corpus:
        docs = make_corpus(a.make_corpus, a.corpus_mb)
        print(f"corpus: {a.make_corpus} ({docs:,} documents, {a.make_corpus.stat().st_size / 1e6:.1f} MB)")
    if a.train_tokenizer:
        corpus = a.make_corpus or (Path(a.input) if a.input else None)
        if corpus is None:
            p.error("--train-tokenizer needs --make-corpus or --input")
        train_tokenizer(corpus, a.train_tokenizer, a.vocab_size)
        print(f"tokenizer: {a.train_tokenizer} (byte-level BPE, vocab {a.vocab_size})")
    if not a.input or not a.tokenizer:
        if a.make_corpus or a.train_tokenizer:
            return 0
        p.error("--input and --tokenizer are required to measure")

    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="preprocess_bench_"))
    workdir.mkdir(parents=True, exist_ok=True)
    input_bytes = os.path.getsize(a.input)
    print(f"input {a.input} ({input_bytes / 1e6:.1f} MB), tokenizer {a.tokenizer}, workers {a.workers}")
    ours = measure(
        "ours", lambda i, o: _ours_cmd(i, a.tokenizer, o, a.workers), a.input, workdir, _env(), input_bytes, a.repeat
    )
    print(ours.line())
    if a.megatron_lm:
        mlm_path = os.pathsep.join(filter(None, [a.megatron_lm, a.megatron_pythonpath]))
        theirs = measure(
            "megatron-lm",
            lambda i, o: _megatron_cmd(a.megatron_lm, i, a.tokenizer, o, a.workers),
            a.input,
            workdir,
            _env(mlm_path),
            input_bytes,
            a.repeat,
        )
        print(theirs.line())
        same = all(
            (workdir / f"ours_text_document{ext}").read_bytes()
            == (workdir / f"megatron-lm_text_document{ext}").read_bytes()
            for ext in (".bin", ".idx")
        )
        e2e = (ours.tokens / ours.wall_s) / (theirs.tokens / theirs.wall_s)
        proc = (ours.tokens / ours.processing_s) / (theirs.tokens / theirs.processing_s)
        per_cpu = (ours.tokens / ours.processing_cpu_s) / (theirs.tokens / theirs.processing_cpu_s)
        print(
            f"ratio ours/megatron-lm tokens/s: {e2e:.2f}x end-to-end, {proc:.2f}x processing only, "
            f"{per_cpu:.2f}x per CPU-second; outputs byte-identical: {same}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
