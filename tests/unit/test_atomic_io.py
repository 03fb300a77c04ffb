"""The one atomic-write helper: all or nothing, no temp files left, readable permissions."""

import re
import stat

import pytest

from megatron_osprey.base.atomic_io import atomic_path, temp_name_regex, write_json_atomic, write_text_atomic


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "out.txt"
    write_text_atomic(target, "old\n")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_temp_names_match_the_stray_pattern_and_outputs_are_world_readable(tmp_path):
    target = tmp_path / "shard-a-000001.safetensors"
    with atomic_path(target) as tmp:
        assert re.fullmatch(temp_name_regex(r"shard-a-\d{6}\.safetensors"), tmp.name)
        assert not re.fullmatch(temp_name_regex(r"shard-b-\d{6}\.safetensors"), tmp.name)
        tmp.write_bytes(b"x")
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    write_json_atomic(tmp_path / "a.json", {"b": 1, "a": "é"}, sort_keys=True)
    assert (tmp_path / "a.json").read_text(encoding="utf-8") == '{\n  "a": "é",\n  "b": 1\n}\n'
