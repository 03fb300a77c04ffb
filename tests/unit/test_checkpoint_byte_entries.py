"""A checkpoint's byte entries (the RNG state, TE's _extra_state) as untrusted input, its checksum record required,
and its latest pointer required beside saved iterations."""

import dataclasses
import inspect
import io
import os
import pickle
import random
import shutil

import numpy as np
import pytest
import torch

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.base.checksums import CHECKSUMS_FILE
from megatron_osprey.models.backbone.gpt import build_gpt_model
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.testing.tiny_models import qwen3_config
from megatron_osprey.training.checkpoint_state import capture_rng_state, restore_rng_state, rng_sharded_object
from megatron_osprey.training.checkpointing import (
    LATEST_FILE,
    iteration_dir,
    load_checkpoint,
    resume_iteration,
    save_checkpoint,
)
from megatron_osprey.training.config import CheckpointConfig


def arch():
    return ModelArch.from_hf_config(qwen3_config(layers=2).to_dict())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint holding weights and an RNG state (a byte entry), as a training save writes it."""
    root = tmp_path_factory.mktemp("byte_entries") / "ckpt"
    with parallel_context(ParallelConfig()) as state:
        model = build_gpt_model(arch(), state.config, transformer_impl="local")
        torch.manual_seed(7), random.seed(7), np.random.seed(7)
        sharded = model.sharded_state_dict() | {"rng_state": rng_sharded_object(capture_rng_state())}
        save_checkpoint(root, 3, sharded, {"stage": "test"})
    return root


def load(root, verify=True):
    with parallel_context(ParallelConfig()) as state:
        model = build_gpt_model(arch(), state.config, transformer_impl="local")
        sharded = model.sharded_state_dict() | {"rng_state": rng_sharded_object(None)}
        return load_checkpoint(root, sharded, verify=verify)


class RunsACommand:
    """What an attacker pickles: unpickling it calls os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def craft(saved, tmp_path, marker):
    """The issue's attack: the rng_state entry's bytes replaced by a pickled os.system call (appended to its
    .distcp, the entry's offset and length in .metadata pointed at it), checksums.json and provenance deleted."""
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    path = iteration_dir(root, 3)
    metadata = pickle.loads((path / ".metadata").read_bytes())  # a genuine file of this test's own save
    (index,) = [i for i in metadata.storage_data if i.fqn.startswith("rng_state")]
    info = metadata.storage_data[index]
    payload = io.BytesIO()
    torch.save(RunsACommand(marker), payload)
    shard = path / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as handle:
        handle.write(payload.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload.getvalue()))
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    (path / CHECKSUMS_FILE).unlink()
    (path / "provenance.json").unlink(missing_ok=True)
    return root


def test_the_rng_state_round_trips_as_plain_data(saved, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    state, iteration = load(root)
    rng = state["rng_state"]
    assert iteration == 3 and isinstance(rng["numpy"][1], torch.Tensor)  # no pickled ndarray to decode
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    restore_rng_state(rng)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_a_crafted_byte_entry_is_refused_and_never_runs(saved, tmp_path):
    marker = tmp_path / "pwned"
    root = craft(saved, tmp_path, marker)
    # Without checksums.json the load is refused before anything is read ...
    with pytest.raises(ValueError, match=rf"^{iteration_dir(root, 3) / CHECKSUMS_FILE} is missing: .* --skip-checksum"):
        load(root)
    # ... and under --skip-checksum the entry is decoded weights-only: refused by name, nothing runs.
    with pytest.raises(
        ValueError,
        match=r"refusing to load this checkpoint: its entry 'rng_state.*' references posix\.system, which a "
        r"checkpoint's byte entries never hold\. Load only checkpoints you trust\.$",
    ):
        load(root, verify=False)
    assert not marker.exists()
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    from megatron_osprey.training.checkpoint_files import PlainDataLoadPlanner

    assert mcore_torch.MCoreLoadPlanner is not PlainDataLoadPlanner  # megatron-core's name is put back, even on error


def test_an_rng_state_saved_with_a_numpy_array_still_loads(saved, tmp_path):
    """Checkpoints saved before the RNG state went plain hold NumPy's keys as a pickled ndarray."""
    from megatron_osprey.training.checkpoint_files import decode_byte_entry

    old = io.BytesIO()
    torch.save({"numpy": np.random.get_state(), "torch": torch.get_rng_state()}, old)
    old.seek(0)
    decoded = decode_byte_entry(old, "rng_state")
    assert np.array_equal(decoded["numpy"][1], np.random.get_state()[1])


def test_a_missing_latest_pointer_beside_iterations_is_named_not_a_fresh_start(saved, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    (root / LATEST_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=rf"^{root / LATEST_FILE} is missing but {root} holds 1 iterations "):
        resume_iteration(CheckpointConfig(load=str(root)))
    with pytest.raises(FileNotFoundError, match=r"holds 1 iterations \(the last iter_0000003\)"):
        load(root)
    assert resume_iteration(CheckpointConfig(load=str(root), ckpt_step=3)) == 3  # a named one is still loadable
    assert resume_iteration(CheckpointConfig(load=str(tmp_path / "empty"))) is None  # nothing saved yet: fresh


def test_megatrons_load_still_builds_the_planner_by_the_name_we_substitute():
    """PlainDataLoadStrategy.load substitutes PlainDataLoadPlanner for the name MCoreLoadPlanner that megatron-core's
    TorchDistLoadShardedStrategy.load builds its planner from (0.16.1 to 0.19.x); a release that builds it otherwise
    would load byte entries undecoded, so it fails here (and the crafted-entry test above fails with it)."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    source = inspect.getsource(mcore_torch.TorchDistLoadShardedStrategy.load)
    assert source.count("MCoreLoadPlanner(") == 1 and "planner=MCoreLoadPlanner(" in source
