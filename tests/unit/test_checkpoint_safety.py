"""Checkpoints as untrusted input: crafted metadata is refused before torch unpickles it; damage is named."""

import os
import pickle
import shutil

import pytest

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.models.backbone.gpt import build_gpt_model
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.training.checkpointing import iteration_dir, load_checkpoint
from tests.distributed.scripts.check_pretrain_fixtures import make_backbone


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    return make_backbone(tmp_path_factory.mktemp("ckpt_safety"))


class RunsACommand:
    """What an attacker pickles: unpickling it calls os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def copy_checkpoint(backbone, tmp_path):
    root = tmp_path / "megatron"
    shutil.copytree(backbone / "megatron", root)
    return root


def load(backbone, root, verify=False):
    """Load the checkpoint; verify=False (--skip-checksum) reaches the reader's own guards, which a damaged or
    crafted file must meet even when its iter_N/checksums.json was rewritten to match."""
    arch = ModelArch.from_hf_config(backbone / "hf")
    with parallel_context(ParallelConfig()) as state:
        model = build_gpt_model(arch, state.config, transformer_impl="local")
        return load_checkpoint(root, model.sharded_state_dict(), verify=verify)


def test_a_crafted_metadata_file_is_refused_without_running_it(backbone, tmp_path):
    root = copy_checkpoint(backbone, tmp_path)
    marker = tmp_path / "pwned"
    (iteration_dir(root, 0) / ".metadata").write_bytes(pickle.dumps(RunsACommand(marker)))
    with pytest.raises(ValueError, match=r"\.metadata is corrupt: it has \d+ bytes but the save recorded"):
        load(backbone, root, verify=True)  # the checksums catch it first
    assert not marker.exists()
    with pytest.raises(
        ValueError,
        match=r"\.metadata: refusing to load this checkpoint: it references "
        r"posix\.system.*Load only checkpoints you trust",
    ):
        load(backbone, root)
    assert not marker.exists()


def test_a_genuine_checkpoint_loads_and_a_truncated_one_is_named(backbone, tmp_path):
    root = copy_checkpoint(backbone, tmp_path)
    state, iteration = load(backbone, root, verify=True)
    assert iteration == 0 and state
    shard = sorted(iteration_dir(root, 0).glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"the checkpoint cannot be read .* truncated or corrupt"):
        load(backbone, root)
    (iteration_dir(root, 0) / ".metadata").write_bytes((iteration_dir(root, 0) / ".metadata").read_bytes()[:40])
    with pytest.raises(ValueError, match=r"\.metadata is truncated or corrupt"):
        load(backbone, root)


def test_a_full_disk_during_a_save_says_so_and_leaves_the_last_checkpoint(backbone, tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing

    from megatron_osprey.training.checkpointing import read_latest_iteration, save_checkpoint

    root = copy_checkpoint(backbone, tmp_path)
    arch = ModelArch.from_hf_config(backbone / "hf")

    def out_of_space(*args, **kwargs):  # what torch's zip writer raises when a write comes up short
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")

    monkeypatch.setattr(dist_checkpointing, "save", out_of_space)
    with parallel_context(ParallelConfig()) as state:
        model = build_gpt_model(arch, state.config, transformer_impl="local")
        with pytest.raises(
            OSError,
            match=r"saving iteration 5 to .* failed: the disk is full \(.* MiB free\)\. "
            r"The previous checkpoint and the latest pointer are untouched",
        ):
            save_checkpoint(root, 5, model.sharded_state_dict(), {"stage": "test"})
    assert read_latest_iteration(root) == 0 and not iteration_dir(root, 5).exists()


def test_a_truncated_safetensors_file_is_named(backbone, tmp_path):
    from megatron_osprey.convert.safetensors_io import SafetensorsCheckpoint

    shutil.copytree(backbone / "hf", tmp_path / "hf")
    weights = next((tmp_path / "hf").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=rf"{weights.name} is not a readable safetensors file .* truncated or corrupt"):
        SafetensorsCheckpoint(tmp_path / "hf")
