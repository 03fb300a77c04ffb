"""Preprocessing memory is bounded per document: a 15 MB line is tokenized in pieces, normal documents whole."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_osprey.data.token_encoding import split_long_text
from megatron_osprey.testing.tiny_models import write_byte_level_bpe

EOS = "<eos>"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A small byte-level BPE with an eos token named in tokenizer_config.json."""
    texts = ["the quick brown fox jumps over the lazy dog", "héllo indexed tokens"] * 3
    return write_byte_level_bpe(tmp_path_factory.mktemp("tok"), texts, 300, ["<pad>", EOS], {"eos_token": EOS})


REPO = Path(__file__).resolve().parents[2]
# Peak RSS (KiB, VmHWM) of a child that reads and encodes one JSONL file; `encode` False stops before tokenizing.
CHILD = """
import sys
from megatron_osprey.data.fast_tokenizer import load_tokenizer_spec
from megatron_osprey.data.text_sources import RecordBatch
from megatron_osprey.data.token_encoding import BatchEncoder
import megatron_osprey.data.token_encoding as te
if sys.argv[4] != "default":
    te.LONG_DOCUMENT_CHARS = int(sys.argv[4])
encoder = BatchEncoder(load_tokenizer_spec(sys.argv[1]), "text")
lines = open(sys.argv[2], "rb").read().splitlines()
if sys.argv[3] == "encode":
    out = encoder.encode(RecordBatch(0, "jsonl", lines))
    assert out.doc_lengths.size == 1 and out.tokens.size > 1
# VmHWM is this program's own peak; ru_maxrss would keep the parent's RSS from before exec (a large pytest).
print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def peak_rss_kib(tokenizer, data, mode, limit="default"):
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tokenizer), str(data), mode, str(limit)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        env={"PATH": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


def test_a_15_mb_line_needs_memory_of_a_piece_not_of_the_document(tokenizer_dir, tmp_path):
    words = ["quick", "brown", "fox", "lazy", "dog", "tokens", "héllo", "indexed"]
    rng = np.random.default_rng(0)
    text = "".join(
        " ".join(words[i] for i in rng.integers(0, len(words), 12)) + ("\n" if k % 7 == 6 else " ")
        for k in range(220_000)
    )
    assert len(text.encode()) > 15e6
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"text": text}) + "\n")
    loaded = peak_rss_kib(tokenizer_dir, data, "read")
    whole = peak_rss_kib(tokenizer_dir, data, "encode", limit=1 << 40) - loaded  # one piece: as before
    pieces = peak_rss_kib(tokenizer_dir, data, "encode") - loaded
    print(f"peak RSS above reading: whole document {whole} KiB, in pieces {pieces} KiB")
    assert pieces * 3 < whole


def test_pieces_are_cut_after_line_ends_and_rejoin_to_the_text():
    text = "ab cd\nef gh\n" * 50 + "x" * 30
    pieces = split_long_text(text, 16)
    assert "".join(pieces) == text and max(map(len, pieces)) <= 16
    assert all(p.endswith("\n") for p in pieces[:-2])
    assert split_long_text("short", 16) == ["short"]


def test_normal_documents_are_tokenized_whole_and_a_long_one_as_its_pieces(tokenizer_dir, monkeypatch):
    from tokenizers import Tokenizer

    import megatron_osprey.data.token_encoding as te
    from megatron_osprey.data.fast_tokenizer import load_tokenizer_spec
    from megatron_osprey.data.text_sources import RecordBatch

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    spec = load_tokenizer_spec(str(tokenizer_dir))
    docs = ["line one\nline two " * 40, "short text", "x y z " * 100]
    lines = [json.dumps({"text": d}).encode() for d in docs]
    out = te.BatchEncoder(spec, "text").encode(RecordBatch(0, "jsonl", lines))
    whole = [t for d in docs for t in [*tok.encode(d).ids, spec.eod_id]]
    assert out.tokens.tolist() == whole  # what the .bin held before: the documents unchanged
    monkeypatch.setattr(te, "LONG_DOCUMENT_CHARS", 25)
    out = te.BatchEncoder(spec, "text").encode(RecordBatch(0, "jsonl", lines))
    pieces = [t for d in docs for t in [*(i for p in split_long_text(d, 25) for i in tok.encode(p).ids), spec.eod_id]]
    assert out.tokens.tolist() == pieces and out.doc_lengths.tolist() == [
        sum(len(tok.encode(p).ids) for p in split_long_text(d, 25)) + 1 for d in docs
    ]
