"""Checkpoints carry a sha256 per file, recorded at save and verified on load."""

import json

import pytest

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.base.checksums import CHECKSUMS_FILE
from megatron_osprey.models.backbone.gpt import build_gpt_model
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.testing.tiny_models import qwen3_config
from megatron_osprey.training.checkpointing import LATEST_FILE, iteration_dir, load_checkpoint, save_checkpoint


def arch():
    return ModelArch.from_hf_config(qwen3_config(layers=2).to_dict())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("checksums") / "ckpt"
    with parallel_context(ParallelConfig()) as state:
        model = build_gpt_model(arch(), state.config, transformer_impl="local")
        save_checkpoint(root, 3, model.sharded_state_dict(), {"stage": "test"})
    return root


def load(root, verify=True):
    with parallel_context(ParallelConfig()) as state:
        model = build_gpt_model(arch(), state.config, transformer_impl="local")
        return load_checkpoint(root, model.sharded_state_dict(), verify=verify)


def copy(saved, tmp_path):
    import shutil

    shutil.copytree(saved, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_every_file_of_a_saved_iteration_is_recorded_and_a_clean_copy_loads(saved, tmp_path):
    path = iteration_dir(saved, 3)
    recorded = json.loads((path / CHECKSUMS_FILE).read_text())["files"]
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name != CHECKSUMS_FILE}
    assert set(recorded) == on_disk and any(name.endswith(".distcp") for name in recorded)
    assert (saved / LATEST_FILE).read_text().strip() == "3"
    assert load(copy(saved, tmp_path))[1] == 3


def test_a_bit_flipped_distcp_of_the_same_size_is_refused_naming_it(saved, tmp_path):
    root = copy(saved, tmp_path)
    shard = sorted(iteration_dir(root, 3).glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"^{shard} is corrupt: it has sha256 \w+\.\.\. but the save recorded "):
        load(root)
    assert load(root, verify=False)[1] == 3  # --skip-checksum loads what is there


def test_a_missing_file_is_named(saved, tmp_path):
    root = copy(saved, tmp_path)
    common = iteration_dir(root, 3) / "common.pt"
    common.unlink()
    with pytest.raises(ValueError, match=rf"{common} is missing"):
        load(root)


class RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_crafted_common_pt_is_one_value_error_and_runs_nothing(saved, tmp_path):
    import pickle

    from megatron_osprey.training.checkpointing import load_common_state

    root = copy(saved, tmp_path)
    path = iteration_dir(root, 3)
    marker = tmp_path / "pwned"
    (path / "common.pt").write_bytes(pickle.dumps({"x": RunsACommand(marker)}))
    with pytest.raises(ValueError, match=rf"^{path / 'common.pt'}: refusing to load this checkpoint \(UnpicklingError"):
        load_common_state(path)
    assert not marker.exists()
