"""--overwrite deletes only a stage's own output, never an input or a directory it did not write."""

import json

import pytest

from megatron_osprey.base.outputs import prepare_output
from megatron_osprey.base.provenance import PROVENANCE_FILE


def _own_output(directory, stage="export"):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / PROVENANCE_FILE).write_text(json.dumps({"stage": stage}))
    (directory / "model.safetensors").write_bytes(b"old")
    return directory


def test_an_output_that_is_the_parent_of_the_input_is_refused_and_nothing_is_deleted(tmp_path):
    # The reproduction: export --checkpoint X/drafter --output X --overwrite.
    drafter = tmp_path / "X" / "drafter"
    drafter.mkdir(parents=True)
    (drafter / "weights").write_bytes(b"w")
    (tmp_path / "X" / "notes.txt").write_text("mine")
    (tmp_path / "X" / PROVENANCE_FILE).write_text(json.dumps({"stage": "export"}))
    with pytest.raises(ValueError, match=r"--output .*X contains the input --checkpoint \(.*drafter\)"):
        prepare_output(tmp_path / "X", {"--checkpoint": drafter}, PROVENANCE_FILE, overwrite=True, stage="export")
    assert (drafter / "weights").read_bytes() == b"w"
    assert (tmp_path / "X" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("relation", ["same", "inside"])
def test_an_output_equal_to_or_inside_an_input_is_refused(tmp_path, relation):
    source = _own_output(tmp_path / "source")
    output = source if relation == "same" else source / "out"
    expected = "is the input" if relation == "same" else "lies inside the input"
    with pytest.raises(ValueError, match=f"{expected} --source"):
        prepare_output(output, {"--source": source, "--other": None}, PROVENANCE_FILE, overwrite=True)
    assert (source / "model.safetensors").read_bytes() == b"old"


def test_an_input_reached_through_a_symbolic_link_is_still_seen(tmp_path):
    real = tmp_path / "real"
    (real / "ckpt").mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ValueError, match="contains the input"):
        prepare_output(link, {"--checkpoint": real / "ckpt"}, PROVENANCE_FILE, overwrite=True)


def test_a_home_like_directory_of_unrelated_files_is_never_deleted(tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("key")
    (home / "thesis.tex").write_text("years")
    with pytest.raises(ValueError, match=rf"--output {home} is not empty and has no {PROVENANCE_FILE}"):
        prepare_output(home, {"--checkpoint": tmp_path / "elsewhere"}, PROVENANCE_FILE, overwrite=True)
    assert sorted(p.name for p in home.iterdir()) == [".ssh", "thesis.tex"]


def test_without_overwrite_a_non_empty_output_is_refused(tmp_path):
    out = _own_output(tmp_path / "out")
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        prepare_output(out, {}, PROVENANCE_FILE, overwrite=False)
    assert (out / "model.safetensors").exists()


def test_another_stages_output_is_not_deleted(tmp_path):
    out = _own_output(tmp_path / "out", stage="prune")
    with pytest.raises(ValueError, match="holds the output of the prune stage, not of export"):
        prepare_output(out, {}, PROVENANCE_FILE, overwrite=True, stage="export")
    assert (out / "model.safetensors").exists()


def test_the_stages_own_output_is_emptied_and_a_missing_one_created(tmp_path):
    out = _own_output(tmp_path / "out")
    assert prepare_output(out, {"--checkpoint": tmp_path / "ckpt"}, PROVENANCE_FILE, True, stage="export") == out
    assert out.is_dir() and list(out.iterdir()) == []
    fresh = tmp_path / "a" / "b"
    prepare_output(fresh, {}, "extract_settings.json", overwrite=False)
    assert fresh.is_dir()


def test_a_file_as_output_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        prepare_output(tmp_path / "f", {}, PROVENANCE_FILE, overwrite=True)


def test_extract_overwrite_refuses_a_store_it_did_not_write(tmp_path):
    from types import SimpleNamespace

    from megatron_osprey.data.extract import check_store_settings

    store = tmp_path / "store"
    store.mkdir()
    (store / "notes.txt").write_text("mine")
    config = SimpleNamespace(
        store=SimpleNamespace(store_dir=str(store)),
        data_path=str(tmp_path / "data.jsonl"),
        target=SimpleNamespace(path=str(tmp_path / "target")),
        overwrite=True,
    )
    with pytest.raises(ValueError, match="has no extract_settings.json"):
        check_store_settings(config, {"x": 1}, say=lambda _: None)
    assert (store / "notes.txt").read_text() == "mine"
    config.store.store_dir = str(tmp_path)  # the store would hold --data and --target
    with pytest.raises(ValueError, match="contains the input --data"):
        check_store_settings(config, {"x": 1}, say=lambda _: None)


def test_a_corrupt_store_shard_is_an_input_error():
    from megatron_osprey.data.hidden_state_store import CorruptShardError

    assert issubclass(CorruptShardError, ValueError)  # stages print it as one `error:` line, exit 2


def test_an_output_that_cannot_be_created_or_written_is_named(tmp_path):
    from megatron_osprey.base.outputs import check_output_writable

    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match=r"^--out .*file\.txt/o cannot be written"):
        check_output_writable(tmp_path / "file.txt" / "o", flag="--out")
    assert check_output_writable(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert list((tmp_path / "a" / "b").iterdir()) == []


@pytest.mark.parametrize("stage", ["export", "prune", "ngram"])
def test_a_symlinked_output_is_refused_by_name_before_anything_is_deleted(tmp_path, stage):
    # The case: --output LINK --overwrite ran the whole stage, then failed in rmtree with no name.
    real = _own_output(tmp_path / "real", stage=stage)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ValueError, match=rf"^--output {link} is a symbolic link \(to {real}\); give the directory"):
        prepare_output(link, {}, PROVENANCE_FILE, overwrite=True, stage=stage)
    assert (real / "model.safetensors").read_bytes() == b"old" and link.is_symlink()


def test_a_claimed_output_is_marked_until_its_record_and_a_partial_one_is_its_stages_own(tmp_path):
    from megatron_osprey.base.outputs import WRITER_LOCK, check_not_partial, claimed_output
    from megatron_osprey.base.provenance import WRITING_MARKER, write_provenance

    out = tmp_path / "out"
    with pytest.raises(ValueError, match="bad input"):  # refused before writing anything: the output stays free
        with claimed_output(out, {}, False, stage="ngram"):
            raise ValueError("bad input")
    assert [p.name for p in out.iterdir()] == [WRITER_LOCK]
    with pytest.raises(RuntimeError):
        with claimed_output(out, {}, False, stage="ngram"):
            (out / "ngram.npz").write_bytes(b"half")
            raise RuntimeError("killed")
    with pytest.raises(ValueError, match=rf"--drafter {out} is a partial ngram output: .*{WRITING_MARKER}"):
        check_not_partial(out, "--drafter")
    with pytest.raises(ValueError, match="holds the output of the ngram stage, not of export"):
        prepare_output(out, {}, PROVENANCE_FILE, overwrite=True, stage="export")
    with claimed_output(out, {}, True, stage="ngram"):
        assert sorted(p.name for p in out.iterdir()) == [WRITER_LOCK, WRITING_MARKER]
        (out / "ngram.npz").write_bytes(b"whole")
        write_provenance(out, "ngram", {}, {"tables": out / "ngram.npz"})
    check_not_partial(out, "--drafter")
    assert sorted(p.name for p in out.iterdir()) == [WRITER_LOCK, "ngram.npz", PROVENANCE_FILE]
