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
