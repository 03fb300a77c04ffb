"""Provenance digests of large files are remembered by stat, and a file written since is hashed again."""

import os

import pytest

from megatron_osprey.base import provenance
from megatron_osprey.base.checksums import file_sha256


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """A small REMEMBER_FROM_BYTES, a private cache, and a count of the files actually hashed."""
    monkeypatch.setenv("OSPREY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(provenance, "REMEMBER_FROM_BYTES", 1024)
    hashed = []

    def counting(path, *args, **kwargs):
        hashed.append(os.path.basename(path))
        return file_sha256(path, *args, **kwargs)

    monkeypatch.setattr(provenance, "file_sha256", counting)
    return hashed


def test_a_large_file_is_hashed_once_and_small_ones_every_time(counted, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "weights.bin").write_bytes(os.urandom(4096))
    (model / "tokenizer.json").write_text("{}")
    first = provenance.digest(model)
    second = provenance.digest(model)
    assert first == second
    assert counted.count("weights.bin") == 1 and counted.count("tokenizer.json") == 2


def test_a_file_rewritten_with_its_old_size_and_mtime_is_hashed_again(counted, tmp_path):
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"a" * 4096)
    before = provenance.digest(weights.parent)
    stat = weights.stat()
    weights.write_bytes(b"b" * 4096)  # same size
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the old mtime: ctime still moves
    after = provenance.digest(weights.parent)
    assert after != before and counted.count("weights.bin") == 2
    # the remembered digest equals a fresh one
    assert provenance.remembered_sha256(weights) == file_sha256(weights)


def test_two_eval_sets_in_one_directory_each_keep_their_check(tmp_path, capsys):
    # The case: two outputs of one stage in one folder; the second record used to replace the first, so the first
    # file could then be edited and read unchecked.
    import json

    from megatron_osprey.stages.suite import main
    from tests.unit.test_eval_suites import ROWS, write_jsonl

    source = write_jsonl(tmp_path / "src.jsonl", [{**ROWS["math500"][0], "unique_id": f"t/{i}"} for i in range(3)])
    first, second = tmp_path / "sets" / "a.jsonl", tmp_path / "sets" / "b.jsonl"
    for out in (first, second):
        assert main(["--suite", "math500", "--source", str(source), "--output", str(out)]) == 0
    assert provenance.check_input("--data", first)["sha256"] == file_sha256(first)
    first.write_text(first.read_text().replace("1+1", "2+2"))
    with pytest.raises(provenance.ProvenanceError, match=r"input --data .*a\.jsonl has sha256 .* suite stage"):
        provenance.check_input("--data", first)
    provenance.check_input("--data", second)  # its own record, untouched
    record = json.loads(provenance.file_record(first).read_text())
    assert record["outputs"]["eval_set"]["path"] == "a.jsonl"


def test_an_input_reached_through_a_symbolic_link_is_checked_where_it_points(tmp_path):
    # The case: the record was looked up beside the link, where there is none, so an edited file passed.
    out = tmp_path / "regenerated"
    out.mkdir()
    data = out / "train.jsonl"
    data.write_text('{"id": 1}\n')
    provenance.write_provenance(out, "regenerate", {}, {"train": data})
    link = tmp_path / "elsewhere" / "train.jsonl"
    link.parent.mkdir()
    link.symlink_to(data)
    assert provenance.check_input("--data", link)["path"] == str(data)
    data.write_text('{"id": 2}\n')
    with pytest.raises(provenance.ProvenanceError, match=rf"input --data {link} has sha256 .* regenerate stage"):
        provenance.check_input("--data", link)


def test_a_directory_digest_skips_file_records_and_the_writing_marker(tmp_path):
    (tmp_path / "a.jsonl").write_text("x\n")
    before = provenance.digest(tmp_path)
    provenance.file_record(tmp_path / "a.jsonl").write_text("{}")
    (tmp_path / provenance.WRITING_MARKER).write_text('{"stage": "data"}')
    assert provenance.digest(tmp_path) == before


def test_an_input_inside_a_partial_output_is_refused_naming_the_stage(tmp_path):
    # A data run killed after writing prompts/ but before eval/ and its record: each file is whole, the set is not.
    out = tmp_path / "data"
    (out / "prompts").mkdir(parents=True)
    (out / "prompts" / "chat.jsonl").write_text('{"id": "a"}\n')
    (out / provenance.WRITING_MARKER).write_text('{"stage": "data"}')
    with pytest.raises(provenance.ProvenanceError, match=r"input --input .*chat\.jsonl lies in .*data, a partial data"):
        provenance.check_input("--input", out / "prompts" / "chat.jsonl")
    provenance.write_provenance(out, "data", {}, {"prompts/chat": out / "prompts" / "chat.jsonl"})
    assert not (out / provenance.WRITING_MARKER).exists()
    provenance.check_input("--input", out / "prompts" / "chat.jsonl")
