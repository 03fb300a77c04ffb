"""Stage-2 preprocessing: JSONL/Parquet/datasets -> Megatron indexed dataset."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from megatron_osprey.data.indexed_writer import AtomicIndexedWriter
from megatron_osprey.data.preprocess import partition_prefix, preprocess
from megatron_osprey.data.text_sources import open_text_source
from megatron_osprey.recipes import run_stage
from megatron_osprey.stages.preprocess import PreprocessConfig
from megatron_osprey.testing.tiny_models import write_byte_level_bpe

REPO = Path(__file__).resolve().parents[2]
EOS = "<eos>"
DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts tokens that the target verifies.",
    "héllo wörld — unicode ✓",
    "short",
    "Megatron indexed datasets store tokens in a .bin and offsets in an .idx.",
    "one more line of ordinary text to tokenize",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE trained on DOCS, with an eos token named in tokenizer_config.json."""
    return write_byte_level_bpe(tmp_path_factory.mktemp("tok"), DOCS * 3, 400, ["<pad>", EOS], {"eos_token": EOS})


def _tok(tokenizer_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def _write_jsonl(path: Path, docs, key="text") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({key: d, "id": "x"}) + "\n")
    return path


def _run(inp, tokenizer_dir, prefix, **kw):
    cfg = PreprocessConfig(
        input=str(inp), tokenizer=str(tokenizer_dir), output_prefix=str(prefix), progress=False, **kw
    )
    return preprocess(cfg)


def _bytes(prefix: str) -> tuple:
    return Path(prefix + ".bin").read_bytes(), Path(prefix + ".idx").read_bytes()


def test_output_has_expected_ids_and_eod_per_document(tmp_path, tokenizer_dir):
    inp = _write_jsonl(tmp_path / "in.jsonl", DOCS)
    # Tiny batches so 2 workers really interleave several batches that must come back in order.
    result = _run(inp, tokenizer_dir, tmp_path / "out", workers=2, batch_bytes=64)
    tok = _tok(tokenizer_dir)
    eod = tok.token_to_id(EOS)
    assert result.eod_id == eod == 1
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert ds.index.dtype == np.uint16  # vocab 400 < 65500
    assert len(ds) == len(DOCS)
    assert list(ds.document_indices) == list(range(len(DOCS) + 1))
    for i, text in enumerate(DOCS):
        assert ds[i].tolist() == tok.encode(text).ids + [eod]
    assert result.stats.tokens == sum(len(tok.encode(t).ids) + 1 for t in DOCS)
    assert result.stats.documents == len(DOCS)
    assert not os.path.exists(str(tmp_path / "out_text_document.bin.partial"))


def test_batched_writes_equal_builder_add_document(tmp_path):
    rng = np.random.default_rng(0)
    lengths = np.array([3, 1, 7, 2], dtype=np.int32)
    tokens = rng.integers(0, 60000, size=int(lengths.sum())).astype(np.uint16)
    ref = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.uint16)
    start = 0
    for n in lengths:
        ref.add_document(tokens[start : start + n], [int(n)])
        start += n
    ref.finalize(str(tmp_path / "ref.idx"))
    w = AtomicIndexedWriter(str(tmp_path / "ours"), np.uint16)
    w.add_documents(tokens[:4], lengths[:2])
    w.add_documents(tokens[4:], lengths[2:])
    w.commit()
    assert _bytes(str(tmp_path / "ours")) == _bytes(str(tmp_path / "ref"))


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_merged_parts_equal_megatron_builder_add_index(tmp_path, dtype):
    """Our .idx writer and partition merge (no megatron.core import) give megatron.core's bytes, part by part."""
    rng = np.random.default_rng(1)
    parts = [np.array([5, 2], np.int32), np.array([], np.int32), np.array([1, 9, 4], np.int32)]
    ref = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=dtype)
    ours = AtomicIndexedWriter(str(tmp_path / "ours"), dtype)
    for k, lengths in enumerate(parts):
        tokens = rng.integers(0, 60000, size=int(lengths.sum())).astype(dtype)
        part = AtomicIndexedWriter(str(tmp_path / f"part{k}"), dtype)
        part.add_documents(tokens, lengths)
        part.commit()
        ref.add_index(str(tmp_path / f"part{k}"))
        ours.add_index(str(tmp_path / f"part{k}"))
    ref.finalize(str(tmp_path / "ref.idx"))
    ours.commit()
    assert _bytes(str(tmp_path / "ours")) == _bytes(str(tmp_path / "ref"))
    ours_ds, ref_ds = IndexedDataset(str(tmp_path / "ours")), IndexedDataset(str(tmp_path / "ref"))
    assert len(ours_ds) == 5 and [ours_ds[i].tolist() for i in range(5)] == [ref_ds[i].tolist() for i in range(5)]


def test_preprocessing_does_not_import_megatron_core():
    """The stage's start-up stays free of megatron.core (and torch): seconds per run, for writing one file format."""
    code = (
        "import sys; import megatron_osprey.recipes, megatron_osprey.stages.preprocess, "
        "megatron_osprey.data.preprocess; print(sorted(m for m in ('megatron.core', 'torch') if m in sys.modules))"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_compressed_parquet_and_datasets_inputs_give_identical_output(tmp_path, tokenizer_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    from datasets import Dataset

    plain = _write_jsonl(tmp_path / "in.jsonl", DOCS)
    raw = plain.read_bytes()
    (tmp_path / "in.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "in.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    pq.write_table(pa.table({"id": ["x"] * len(DOCS), "text": DOCS}), tmp_path / "in.parquet", row_group_size=3)
    Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "in_ds"))

    _run(plain, tokenizer_dir, tmp_path / "plain")
    expected = _bytes(str(tmp_path / "plain_text_document"))
    for name in ("in.jsonl.gz", "in.jsonl.zst", "in.parquet", "in_ds"):
        prefix = tmp_path / name.replace(".", "_")
        result = _run(tmp_path / name, tokenizer_dir, prefix, batch_bytes=100)
        assert _bytes(str(prefix) + "_text_document") == expected, name
        assert result.stats.documents == len(DOCS), name


def test_malformed_records_are_counted_reported_and_skipped(tmp_path, tokenizer_dir, caplog):
    lines = [
        json.dumps({"text": "good one"}),  # line 1
        "{not json",  # line 2
        json.dumps({"other": "x"}),  # line 3: missing key
        json.dumps({"text": 42}),  # line 4: not a string
        json.dumps({"text": ""}),  # line 5: empty
        json.dumps({"text": "  \n "}),  # line 6: whitespace only
        json.dumps(["text"]),  # line 7: not an object
        "",  # line 8: blank line
        json.dumps({"text": "good two"}),  # line 9
    ]
    inp = tmp_path / "bad.jsonl"
    inp.write_text("\n".join(lines + [json.dumps({"x": 1})] * 12) + "\n")  # lines 10-21: missing key
    with caplog.at_level("INFO"):
        result = _run(inp, tokenizer_dir, tmp_path / "out", workers=2, batch_bytes=40)
    s = result.stats
    assert s.documents == 2 and s.records == 21
    assert s.problem_counts == {
        "invalid JSON": 2,
        "missing key": 13,
        "value is not a string": 1,
        "empty document": 2,
        "not a JSON object": 1,
    }
    assert len(s.problems) == 10  # only the first 10 are kept, in input order
    assert [p.split(":")[0] for p in s.problems] == [f"{inp} line {n}" for n in (2, 3, 4, 5, 6, 7, 8, 10, 11, 12)]
    assert "missing key 'text'" in s.problems[1] and "(int)" in s.problems[2]
    tok = _tok(tokenizer_dir)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode(t).ids + [1] for t in ("good one", "good two")]
    assert "skipped 19 records" in caplog.text and f"{inp} line 2: invalid JSON" in caplog.text


def test_strict_fails_on_first_bad_line_and_leaves_no_output(tmp_path, tokenizer_dir):
    inp = tmp_path / "bad.jsonl"
    inp.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"text": "ok"}) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl line 3: invalid JSON"):
        _run(inp, tokenizer_dir, tmp_path / "out", strict=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_partitions_equal_one_pass_and_rerun_redoes_only_missing(tmp_path, tokenizer_dir):
    docs = [f"{DOCS[i % len(DOCS)]} #{i}" for i in range(40)]
    inp = _write_jsonl(tmp_path / "in.jsonl", docs)
    lines = inp.read_text().splitlines()
    lines[2] = lines[35] = "{broken"  # one problem in the first and one in the last partition
    inp.write_text("\n".join(lines) + "\n")
    _run(inp, tokenizer_dir, tmp_path / "one")
    expected = _bytes(str(tmp_path / "one_text_document"))

    first = _run(inp, tokenizer_dir, tmp_path / "p", partitions=3, keep_partitions=True, batch_bytes=200)
    assert first.partitions_written == 3 and first.partitions_reused == 0
    assert _bytes(str(tmp_path / "p_text_document")) == expected
    parts = [partition_prefix(str(tmp_path / "p"), "text", k) for k in range(3)]
    assert [len(IndexedDataset(p)) for p in parts] == [12, 13, 13]

    # Simulate a run that died during partition 1 and before the merge.
    os.remove(parts[1] + ".done.json")
    Path(parts[1] + ".bin").write_bytes(b"half")
    for ext in (".bin", ".idx"):
        os.remove(str(tmp_path / "p_text_document") + ext)
    kept = {k: os.stat(parts[k] + ".bin").st_mtime_ns for k in (0, 2)}
    again = _run(inp, tokenizer_dir, tmp_path / "p", partitions=3, batch_bytes=200)
    assert again.partitions_written == 1 and again.partitions_reused == 2
    assert _bytes(str(tmp_path / "p_text_document")) == expected
    assert again.stats.documents == 38 and again.encoded.documents == 13  # totals include reused ones
    assert [p.split(":")[0] for p in again.stats.problems] == [f"{inp} line 3", f"{inp} line 36"]
    assert kept == {k: first_mtime for k, first_mtime in kept.items()}
    # Without --keep-partitions the merged run removes partition files.
    assert not any(os.path.exists(p + ".bin") or os.path.exists(p + ".done.json") for p in parts)


def test_partition_marker_from_other_tokenizer_settings_is_not_reused(tmp_path, tokenizer_dir):
    inp = _write_jsonl(tmp_path / "in.jsonl", DOCS)
    _run(inp, tokenizer_dir, tmp_path / "p", partitions=2, keep_partitions=True)
    os.remove(str(tmp_path / "p_text_document.bin"))
    os.remove(str(tmp_path / "p_text_document.idx"))
    again = _run(inp, tokenizer_dir, tmp_path / "p", partitions=2, add_special_tokens=False, eod_token="<pad>")
    assert again.partitions_written == 2 and again.partitions_reused == 0
    ds = IndexedDataset(str(tmp_path / "p_text_document"))  # keep it alive: items view its mmap
    assert ds[0][-1] == 0  # the new EOD (<pad>) is used


def test_refuses_to_overwrite_unless_asked(tmp_path, tokenizer_dir):
    inp = _write_jsonl(tmp_path / "in.jsonl", DOCS[:2])
    _run(inp, tokenizer_dir, tmp_path / "out")
    before = _bytes(str(tmp_path / "out_text_document"))
    _write_jsonl(inp, DOCS[2:4])
    with pytest.raises(FileExistsError, match="--overwrite"):
        _run(inp, tokenizer_dir, tmp_path / "out")
    assert _bytes(str(tmp_path / "out_text_document")) == before
    _run(inp, tokenizer_dir, tmp_path / "out", overwrite=True)
    assert _bytes(str(tmp_path / "out_text_document")) != before
    assert len(IndexedDataset(str(tmp_path / "out_text_document"))) == 2


def _tool_main(argv):
    """What tools/preprocess_data.py runs: the preprocess stage through the recipe registry."""
    return run_stage("preprocess", argv)


def test_cli_logs_eod_and_reports_errors_in_one_line(tmp_path, tokenizer_dir, capsys, caplog):
    inp = _write_jsonl(tmp_path / "in.jsonl", DOCS[:3])
    argv = [
        "--input",
        str(inp),
        "--json-key",
        "text",
        "--tokenizer",
        str(tokenizer_dir),
        "--output-prefix",
        str(tmp_path / "cli"),
        "--workers",
        "1",
        "--no-progress",
    ]
    # Exit codes follow the stages' shared contract (stages/cli.py): 2 for bad input, one `error:` line.
    with caplog.at_level("INFO"):
        assert _tool_main(argv) == 0
    assert "EOD token '<eos>' (id 1)" in caplog.text
    assert len(IndexedDataset(str(tmp_path / "cli_text_document"))) == 3
    assert _tool_main(argv) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert _tool_main(argv[:1] + [str(tmp_path / "missing.jsonl")] + argv[2:] + ["--overwrite"]) == 2
    assert f"--input {tmp_path / 'missing.jsonl'} does not exist." in capsys.readouterr().err


def test_tokenizer_without_eos_needs_eod_flag(tmp_path, tokenizer_dir):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    inp = _write_jsonl(tmp_path / "in.jsonl", DOCS[:1])
    with pytest.raises(ValueError, match="--eod-token"):
        _run(inp, bare, tmp_path / "out")
    assert _run(inp, bare, tmp_path / "out", eod_token="<pad>").eod_id == 0


def test_missing_column_names_the_flag(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a"]}), tmp_path / "t.parquet")
    with pytest.raises(KeyError, match="--json-key 'text' is not a column"):
        open_text_source(str(tmp_path / "t.parquet"), "text")


def test_hub_name_without_reachable_hub_gives_clear_error():
    import subprocess

    # A fresh interpreter, because datasets reads HF_HUB_OFFLINE at import time.
    code = (
        "from megatron_osprey.data.text_sources import open_text_source\n"
        "try:\n    open_text_source('someuser/somedataset', 'text')\n"
        "except ConnectionError as err:\n    print(err)\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith(
        "--input someuser/somedataset is not a local file or directory, and loading it as a "
        "Hugging Face Hub dataset failed"
    ), out.stdout + out.stderr


@pytest.mark.parametrize("partitions", [1, 2])
def test_an_input_whose_every_record_is_skipped_fails_and_writes_nothing(tmp_path, tokenizer_dir, partitions):
    cases = {
        "wrong_key.jsonl": "".join(json.dumps({"content": d}) + "\n" for d in DOCS).encode(),
        "latin1.jsonl": "".join(
            json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in ["café crème", "naïve façade"]
        ).encode("latin-1"),
        "int_column.jsonl": "".join(json.dumps({"text": i}) + "\n" for i in range(5)).encode(),
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        prefix = tmp_path / f"out_{name}"
        with pytest.raises(ValueError, match=rf"--input .*{name}: all \d+ records were skipped .*nothing was written"):
            _run(tmp_path / name, tokenizer_dir, prefix, partitions=partitions)
        assert not Path(f"{prefix}_text_document.bin").exists() and not Path(f"{prefix}_text_document.idx").exists()


def test_cli_exits_non_zero_on_an_empty_result(tmp_path, tokenizer_dir, capsys):
    inp = _write_jsonl(tmp_path / "in.jsonl", DOCS[:3], key="content")
    argv = [
        "--input",
        str(inp),
        "--json-key",
        "text",
        "--tokenizer",
        str(tokenizer_dir),
        "--output-prefix",
        str(tmp_path / "cli"),
        "--workers",
        "1",
        "--no-progress",
    ]
    assert _tool_main(argv) == 2
    err = capsys.readouterr().err
    assert "all 3 records were skipped (missing key: 3)" in err and "in.jsonl line 1" in err


def test_a_directory_of_shards_is_tokenized_shard_by_shard_and_array_tasks_share_them(tmp_path, tokenizer_dir):
    """FineWeb's Hub layout (a directory of shard files): each shard into DIR/0000i/; array task k of N takes
    shards k, k + N, ...; together the tasks write exactly what one process writes; Stage 2 blends the prefixes
    by token count."""
    from megatron_osprey.stages.preprocess import run
    from megatron_osprey.training.data import parse_blend, token_weights

    shards = tmp_path / "sample" / "100BT"
    shards.mkdir(parents=True)
    for i in range(5):
        _write_jsonl(shards / f"{i:03d}_00000.jsonl", DOCS[i : i + 3])
    (shards / "README.md").write_text("not a shard")

    def config(prefix):
        return PreprocessConfig(
            input=str(shards), tokenizer=str(tokenizer_dir), output_prefix=str(prefix), progress=False, workers=1
        )

    one = config(tmp_path / "one" / "text")
    assert [index for _, index in one.jobs({})] == [0, 1, 2, 3, 4]
    array = {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "1"}
    array["SLURM_ARRAY_TASK_COUNT"] = "2"
    assert [Path(s).name for s, _ in one.jobs(array)] == ["001_00000.jsonl", "003_00000.jsonl"]
    run(one)
    tasks = config(tmp_path / "tasks" / "text")
    for task in ("2", "3", "4"):  # an array of 3 tasks numbered from 2
        run_env = {"SLURM_ARRAY_TASK_ID": task, "SLURM_ARRAY_TASK_MIN": "2", "SLURM_ARRAY_TASK_MAX": "4"}
        run_env["SLURM_ARRAY_TASK_COUNT"] = "3"
        with pytest.MonkeyPatch.context() as patch:
            for key, value in run_env.items():
                patch.setenv(key, value)
            run(tasks)
    assert len(one.output_paths()) == 5
    tokenizer = _tok(tokenizer_dir)
    lengths = []  # per shard, read while its dataset (whose memory map the array views) is alive
    for i, (mine, theirs) in enumerate(zip(one.output_paths(), tasks.output_paths())):
        assert _bytes(mine) == _bytes(theirs)
        record = json.loads(Path(f"{theirs}.provenance.json").read_text())  # each shard's own
        assert record["inputs"]["input"]["path"] == str(shards / f"{i:03d}_00000.jsonl")
        dataset = IndexedDataset(mine)
        lengths.append(dataset.sequence_lengths.tolist())
        del dataset
        assert lengths[-1] == [len(tokenizer.encode(d).ids) + 1 for d in DOCS[i : i + 3]]

    # A requeued task (all three again): its finished shards are skipped, a shard whose output was lost is redone.
    lost = Path(tasks.output_paths()[3])
    for suffix in (".bin", ".idx"):
        Path(str(lost) + suffix).unlink()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {**run_env, "SLURM_ARRAY_TASK_ID": "2"}.items():  # shards 0 and 3
            patch.setenv(key, value)
        redone = run(tasks)
    assert len(redone) == 1 and _bytes(str(lost)) == _bytes(one.output_paths()[3])
    # A shard whose text changed since is not skipped: its output, made from the old text, is refused unless
    # --overwrite, which tokenizes the task's shards again.
    _write_jsonl(shards / "000_00000.jsonl", DOCS[5:8])
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {**run_env, "SLURM_ARRAY_TASK_ID": "2"}.items():
            patch.setenv(key, value)
        with pytest.raises(FileExistsError, match="00000/text_text_document.*pass --overwrite"):
            run(tasks)
        redone = run(dataclasses.replace(tasks, overwrite=True))
    assert len(redone) == 2 and _bytes(tasks.output_paths()[0]) != _bytes(one.output_paths()[0])

    prefixes, weights = parse_blend(one.output_paths())
    assert prefixes == one.output_paths() and weights is None
    assert token_weights(prefixes) == [float(sum(n)) for n in lengths]
    with pytest.raises(ValueError, match="WEIGHT PREFIX pairs"):
        parse_blend(["0.5", *prefixes[:2]])


def test_one_input_is_tokenized_by_the_first_array_task_only_and_an_empty_shard_directory_is_refused(tmp_path):
    single = PreprocessConfig(input=str(tmp_path / "fineweb.jsonl"), output_prefix=str(tmp_path / "text"))
    first = {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "15"}
    first["SLURM_ARRAY_TASK_COUNT"] = "16"
    assert single.jobs(first) == [(single.input, None)] and single.jobs({**first, "SLURM_ARRAY_TASK_ID": "7"}) == []
    assert single.output_paths() == [f"{tmp_path}/text_text_document"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is a directory without shard files"):
        PreprocessConfig(input=str(tmp_path / "empty")).jobs({})
    listed = tmp_path / "files.txt"
    listed.write_text("a.parquet\n\nb.parquet\nc.parquet\n")
    by_list = PreprocessConfig(input_list=str(listed), output_prefix=str(tmp_path / "text"))
    pair = {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "1"}
    assert by_list.jobs({**pair, "SLURM_ARRAY_TASK_COUNT": "2"}) == [("a.parquet", 0), ("c.parquet", 2)]
    # Some tasks of the array resubmitted (3,7) or a stepped array: the tasks could not cover the shards.
    for bad in ({"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "3", "SLURM_ARRAY_TASK_MAX": "7"},
                {**pair, "SLURM_ARRAY_TASK_MAX": "2", "SLURM_ARRAY_TASK_STEP": "2"}):  # fmt: skip
        with pytest.raises(ValueError, match="resubmit the whole array"):
            by_list.jobs({**bad, "SLURM_ARRAY_TASK_COUNT": "2"})
    with pytest.raises(ValueError, match="without its array's bounds"):
        by_list.jobs({"SLURM_ARRAY_TASK_ID": "0"})
    assert by_list.output_paths()[2] == f"{tmp_path}/00002/text_text_document"


def test_the_backbone_recipe_pretrains_on_every_shard_its_preprocessing_array_writes(tmp_path):
    from megatron_osprey.recipes import resolve_recipe

    shards = tmp_path / "fineweb"
    shards.mkdir()
    for i in range(3):
        _write_jsonl(shards / f"{i:03d}_00000.jsonl", DOCS[:2])
    recipe = resolve_recipe("qwen3_4b_backbone_pretrain_10k_64gpu_h100_bf16", [f"paths.pretrain_text={shards}"])
    run_dir = str(tmp_path / "run")
    preprocess = recipe.config("preprocess", run_dir)
    assert preprocess.input == str(shards) and recipe.resources["preprocess"].array_tasks == 16
    assert recipe.config("pretrain", run_dir).data.data_path == [
        f"{run_dir}/preprocess/{i:05d}/text_text_document" for i in range(3)
    ]


def test_a_lone_surrogate_or_deep_nesting_is_a_skipped_record_and_a_truncated_gzip_one_line(
    tmp_path, tokenizer_dir, capsys
):
    # The cases: "\ud800" reached the tokenizer (TypeError), 100k brackets raised RecursionError, a truncated
    # .jsonl.gz raised EOFError: each a traceback.
    import gzip

    lines = [json.dumps({"text": "good one"}), '{"text": "a\\ud800b"}', "[" * 100_000 + "]" * 100_000]
    lines += [json.dumps({"text": "pair \ud83d\ude00 kept"}, ensure_ascii=True)]  # a valid pair is text
    inp = tmp_path / "bad.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    s = _run(inp, tokenizer_dir, tmp_path / "out").stats
    assert s.documents == 2 and s.problem_counts == {"invalid JSON": 2}
    assert s.problems == [f"{inp} line 2: invalid JSON (a lone surrogate escape)",
                          f"{inp} line 3: invalid JSON (brackets nested too deeply)"]  # fmt: skip
    packed = gzip.compress("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5000)).encode())
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(packed[: len(packed) // 2])
    argv = ["--input", str(truncated), "--tokenizer", str(tokenizer_dir), "--output-prefix", str(tmp_path / "cut")]
    assert _tool_main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --input {truncated}: the gzip stream is truncated or damaged after line ")
    assert err.count("\n") == 1 and "Compressed file ended" in err


def test_two_prefixes_in_one_directory_each_keep_their_provenance(tmp_path, tokenizer_dir, capsys):
    # The case (as the demo does with data/general_a and data/general_target): the second run's provenance.json
    # replaced the first's, so the first .bin could be edited and pretraining read it unchecked.
    from megatron_osprey.base.provenance import ProvenanceError, check_input

    inp = _write_jsonl(tmp_path / "in.jsonl", DOCS[:3])
    for name in ("a", "b"):
        argv = ["--input", str(inp), "--tokenizer", str(tokenizer_dir), "--output-prefix", str(tmp_path / "d" / name)]
        assert _tool_main([*argv, "--no-progress"]) == 0
    first = tmp_path / "d" / "a_text_document.bin"
    check_input("data0.bin", first)
    first.write_bytes(first.read_bytes()[:-2] + b"\x00\x00")
    with pytest.raises(ProvenanceError, match=r"input data0\.bin .*a_text_document\.bin has sha256 .* preprocess"):
        check_input("data0.bin", first)
    check_input("data1.bin", tmp_path / "d" / "b_text_document.bin")
