"""Hidden-state extraction end to end on one CPU rank: values, resume after a crash, corrupt shards, refusals."""

from __future__ import annotations

import json
import re

import pytest
import torch

from megatron_osprey.base.arch import ModelArch, default_aux_layer_ids
from megatron_osprey.base.memory import TargetMemoryError
from megatron_osprey.data import hidden_state_store
from megatron_osprey.data.extract import contiguous_slice, extract_hidden_states
from megatron_osprey.data.hidden_state_store import (
    CorruptShardError,
    HiddenStateStore,
    HiddenStateStoreConfig,
    InsufficientDiskError,
)
from megatron_osprey.models.target.config import TargetConfig
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.recipes import run_stage
from megatron_osprey.stages.extract import ExtractConfig
from megatron_osprey.testing.tiny_models import write_chat_target, write_conversations_jsonl
from tests.store_quanta import error_in_quanta


def tool_main(argv):
    """What tools/extract_hidden_states.py runs: the extract stage through the recipe registry."""
    return run_stage("extract", argv)


def parse_shard(text, environ):
    return ExtractConfig(shard=text).shard_slice(environ)


AUX = (1, 2, 4)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("extract")
    hf = write_chat_target(root / "qwen3_moe", "qwen3_moe")
    data = write_conversations_jsonl(root / "conversations.jsonl", 11)
    return root, hf, data


def run(root, data, store, encoding="bf16", on_batch=None):
    config = ExtractConfig(
        target=TargetConfig(path=str(root / "qwen3_moe")),
        data_path=str(data),
        aux_layer_ids=AUX,
        micro_batch_size=2,
        store=HiddenStateStoreConfig(store_dir=str(store), samples_per_shard=3, encoding=encoding),
    )
    arch = ModelArch.from_hf_config(config.target.path)
    with parallel_context(ParallelConfig()) as state:
        return extract_hidden_states(config, state, arch, log=lambda _: None, on_batch=on_batch)


def shard_digests(store) -> dict[str, str]:
    manifest = json.loads((store / "manifest.json").read_text())
    return {s["file"]: s["sha256"] for s in manifest["shards"]}


@pytest.mark.parametrize("encoding", ["bf16", "int8"])
def test_store_holds_hf_hidden_states_and_the_assistant_mask(target, tmp_path, encoding):
    root, hf, data = target
    result = run(root, data, tmp_path / "store", encoding=encoding)
    assert (result.num_samples, result.num_skipped) == (11, 0)
    store = HiddenStateStore(tmp_path / "store", dtype=torch.float32)
    assert len(store) == 11 and store.header.aux_layer_ids == AUX
    worst = {"aux": 0.0, "final": 0.0}
    for sample in store:
        captured = []
        hook = hf.model.layers[-1].register_forward_hook(
            lambda m, i, o: captured.append(o[0] if isinstance(o, tuple) else o)
        )
        with torch.no_grad():
            hidden = hf(sample["input_ids"][None], output_hidden_states=True).hidden_states
        hook.remove()
        aux = torch.cat([hidden[i + 1][0] for i in AUX], dim=-1)
        worst["aux"] = max(worst["aux"], error_in_quanta(sample["aux_hidden"], aux, encoding, len(AUX)))
        # HF's last hidden state is after the final norm: the store keeps the pre-norm one.
        pre_norm = captured[0][0]
        worst["final"] = max(worst["final"], error_in_quanta(sample["final_hidden"], pre_norm, encoding, 1))
        assert (hidden[-1][0] - sample["final_hidden"]).abs().max().item() > 0.1
    print(f"{encoding}: store - HF, in quanta: {worst}")
    # Measured 0.500-0.506 quanta for both encodings (rounding, plus float32 noise at ties);
    # one value off by 10 quanta, or a wrong layer, is far outside one quantum.
    assert max(worst.values()) < 1.0
    sample = store[5]
    assert 0 < sample["loss_mask"].sum() < len(sample["loss_mask"])
    assert sample["sample_id"] == "conv-0005"


def test_killed_midway_then_resumed_gives_the_same_store(target, tmp_path):
    root, _, data = target
    run(root, data, tmp_path / "clean")

    class Crash(RuntimeError):
        pass

    def crash_at_step_3(step):
        if step == 3:
            raise Crash()

    with pytest.raises(Crash):
        run(root, data, tmp_path / "resumed", on_batch=crash_at_step_3)
    # A write interrupted by the kill leaves a temporary file behind.
    (tmp_path / "resumed" / ".shard-rank00000-of-00001-000009.safetensors.x7_q2k9a.tmp").write_bytes(b"partial")
    part = json.loads((tmp_path / "resumed" / "manifest.part-rank00000-of-00001.json").read_text())
    assert len(part["shards"]) == 2 and not part["complete"]  # 8 samples seen, 6 in complete shards
    result = run(root, data, tmp_path / "resumed")
    assert (result.num_samples, result.num_skipped) == (5, 6)
    assert shard_digests(tmp_path / "resumed") == shard_digests(tmp_path / "clean")
    assert not list((tmp_path / "resumed").glob(".*.tmp"))
    again = run(root, data, tmp_path / "resumed")  # a complete store: nothing to do
    assert (again.num_samples, again.num_skipped) == (0, 11)


SHARD_INDEX = re.compile(r"(?:\.tmp-)?shard-rank\d+-of-\d+-(\d+)\.safetensors.*")


def store_files(store) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(store.iterdir()) if p.is_file()}


def test_kill_9_mid_run_then_resume_gives_a_byte_identical_store(target, tmp_path):
    """A real SIGKILL of the extraction tool while it writes shards; the rerun finishes the store."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root, _, data = target
    args = [
        "--target",
        str(root / "qwen3_moe"),
        "--data",
        str(data),
        "--aux-layer-ids",
        "1",
        "2",
        "4",
        "--samples-per-shard",
        "2",
    ]
    killed = tmp_path / "killed"
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(repo))  # as below
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.extract_hidden_states", *args, "--output", str(killed)],
        cwd=repo,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    # Kill while the third shard (index 2) is being written: at its temporary file, or failing
    # that (a write can finish between two polls) once it is complete. Two shards are done by then.
    mid_write = False
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            names = [p.name for p in killed.iterdir()] if killed.is_dir() else []
            writing = [int(m.group(1)) for n in names if (m := SHARD_INDEX.fullmatch(n)) and n.startswith(".tmp-")]
            done = [int(m.group(1)) for n in names if (m := SHARD_INDEX.fullmatch(n)) and n.startswith("shard-")]
            mid_write = any(i >= 2 for i in writing)
            if mid_write or any(i >= 2 for i in done):
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.001)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-3000:]
    print(
        f"killed with SIGKILL {'mid-write' if mid_write else 'after the first shard'}: "
        f"{sorted(p.name for p in killed.iterdir())}"
    )
    assert not (killed / "manifest.json").exists()
    part = json.loads((killed / "manifest.part-rank00000-of-00001.json").read_text())
    assert 2 <= len(part["shards"]) < 6 and not part["complete"]

    # Float sums depend on the thread count: the in-process runs use the killed child's one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert tool_main(args + ["--output", str(killed)]) == 0
        clean = tmp_path / "clean"
        assert tool_main(args + ["--output", str(clean)]) == 0
    finally:
        torch.set_num_threads(threads)
    resumed, uninterrupted = store_files(killed), store_files(clean)
    assert sorted(resumed) == sorted(uninterrupted)
    assert len([n for n in resumed if n.startswith("shard-")]) == 6
    # provenance.json (the stage's record) names its --output: the same record once the paths are swapped.
    resumed["provenance.json"] = resumed["provenance.json"].replace(str(killed).encode(), str(clean).encode())
    for name, content in uninterrupted.items():
        assert resumed[name] == content, name


def test_corrupt_shard_is_detected_when_read(target, tmp_path):
    root, _, data = target
    run(root, data, tmp_path / "store", encoding="int8")
    shard = sorted((tmp_path / "store").glob("shard-*.safetensors"))[1]
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    store = HiddenStateStore(tmp_path / "store")
    store[0]  # the first shard is intact
    with pytest.raises(CorruptShardError, match="sha256"):
        store[4]


def test_short_disk_is_refused_before_loading_the_target(target, tmp_path, monkeypatch):
    root, _, data = target

    class Usage:
        free = 1000

    monkeypatch.setattr(hidden_state_store.format.shutil, "disk_usage", lambda path: Usage())
    with pytest.raises(InsufficientDiskError, match="only 0.00 GiB is free"):
        run(root, data, tmp_path / "store")
    assert not list(tmp_path.glob("store/shard-*"))


def test_tool_refuses_a_layout_that_cannot_fit_before_starting(target, tmp_path, capsys):
    # The stage reports the refusal as one `error:` line and exit code 2 (an input error), not a traceback.
    assert issubclass(TargetMemoryError, ValueError)
    root, _, data = target
    assert (
        tool_main(
            [
                "--target",
                str(root / "qwen3_moe"),
                "--data",
                str(data),
                "--output",
                str(tmp_path / "s"),
                "--gpu-memory-gib",
                "0.001",
                "--aux-layer-ids",
                "1",
                "2",
                "4",
            ]
        )
        == 2
    )
    captured = capsys.readouterr()
    assert re.search(r"^error: .*exceeds --gpu-memory-gib 0\.001", captured.err, re.MULTILINE), captured.err
    assert "per-GPU memory estimate for TP=1 PP=1 EP=1" in captured.out
    assert not (tmp_path / "s").exists()


def test_tool_end_to_end_with_int8_and_a_shard_slice(target, tmp_path):
    root, _, data = target
    args = [
        "--target",
        str(root / "qwen3_moe"),
        "--data",
        str(data),
        "--output",
        str(tmp_path / "s"),
        "--aux-layer-ids",
        "1",
        "2",
        "4",
        "--encoding",
        "int8",
        "--micro-batch-size",
        "3",
    ]
    assert tool_main(args + ["--shard", "1/2"]) == 0
    assert not (tmp_path / "s" / "manifest.json").exists()  # waits for task 0/2
    assert tool_main(args + ["--shard", "0/2"]) == 0
    store = HiddenStateStore(tmp_path / "s")
    assert len(store) == 11 and store.header.encoding == "int8"
    assert sorted(s["sample_id"] for s in store) == [f"conv-{i:04d}" for i in range(11)]


def test_shard_and_slice_selection():
    assert [list(contiguous_slice(11, i, 3)) for i in range(3)] == [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9, 10]]
    assert parse_shard("2/8", {}) == (2, 8)
    assert parse_shard(
        None, {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "16", "SLURM_ARRAY_TASK_MIN": "1"}
    ) == (4, 16)
    assert parse_shard(None, {}) == (0, 1)
    with pytest.raises(ValueError, match="--shard must look like i/n"):
        parse_shard("3", {})
    assert default_aux_layer_ids(62) == [1, 30, 58]  # MiniMax-M2.5's published taps


def run_with(root, data, store, **changes):
    config = ExtractConfig(
        target=TargetConfig(path=str(root / "qwen3_moe")),
        data_path=str(data),
        aux_layer_ids=AUX,
        micro_batch_size=2,
        store=HiddenStateStoreConfig(store_dir=str(store), samples_per_shard=3),
    )
    for key, value in changes.items():
        setattr(config, key, value)
    arch = ModelArch.from_hf_config(config.target.path)
    with parallel_context(ParallelConfig()) as state:
        return extract_hidden_states(config, state, arch, log=lambda _: None)


def test_a_rerun_with_other_data_or_settings_is_refused_or_starts_fresh_with_overwrite(target, tmp_path):
    root, _, data = target
    store = tmp_path / "store"
    run_with(root, data, store)
    ids = [sid for sid in (HiddenStateStore(store)[i]["sample_id"] for i in range(11))]
    # Other conversations with the same ids: resuming by id alone would keep every stale row.
    other = tmp_path / "other.jsonl"
    other.write_text(
        "".join(line.replace('"content": "', '"content": "well, ') + "\n" for line in data.read_text().splitlines())
    )
    with pytest.raises(
        ValueError,
        match=r"--output .*store holds hidden states from other inputs or settings "
        r"\(data_sha256: .*\); resuming would mix them. Pass --overwrite",
    ):
        run_with(root, other, store)
    with pytest.raises(ValueError, match=r"max_length: 4096 -> 64"):
        run_with(root, data, store, max_length=64)
    # Nothing was touched by the refusals: a plain rerun resumes (all complete).
    assert run_with(root, data, store).num_skipped == 11
    result = run_with(root, other, store, overwrite=True)
    assert (result.num_samples, result.num_skipped) == (11, 0)
    fresh = HiddenStateStore(store)
    assert [fresh[i]["sample_id"] for i in range(len(fresh))] == ids
    assert run_with(root, other, store).num_skipped == 11  # the new record now matches


def test_a_second_extract_on_a_locked_writer_says_so_before_loading_the_target(target, tmp_path, monkeypatch):
    import os

    from megatron_osprey.base.locks import acquire_writer_lock
    from megatron_osprey.data import extract

    root, _, data = target
    store = tmp_path / "store"
    run_with(root, data, store)
    # What a running extract's writer holds: the flock, with "pid host" written in the lock file.
    held = acquire_writer_lock(store / ".lock-rank00000-of-00001", f"hidden-state store {store}")
    loaded = []
    monkeypatch.setattr(extract, "load_target", lambda *a, **k: loaded.append(1))
    try:
        with pytest.raises(
            ValueError,
            match=rf"another extract \(pid {os.getpid()} on host .*\) is writing it as writer 'rank00000-of-00001' "
            r"\(lock .* is held\); this run does not wait for it",
        ):
            run_with(root, data, store)
    finally:
        held.release()
    assert not loaded
