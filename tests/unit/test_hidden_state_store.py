"""Hidden-state store: encodings, shards, manifests, resume, corruption, preflight."""

from __future__ import annotations

import itertools
import json
import threading
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_osprey.data import hidden_state_store as hss
from megatron_osprey.data.hidden_state_quant import (
    dequantize_int8,
    loss_delta_under_encoding,
    quantize_int8,
    roundtrip,
)
from megatron_osprey.data.hidden_state_store import (
    CorruptShardError,
    HiddenStateStore,
    HiddenStateStoreConfig,
    HiddenStateWriter,
    InsufficientDiskError,
    StoreMismatchError,
    check_free_disk,
    estimate_store_bytes,
    finalize_store,
    open_store,
    open_writer,
)
from megatron_osprey.data.micro_batches import rank_indices

H = 32
AUX = (1, 4, 7)


def make_samples(n: int, hidden: int = H, seed: int = 0, prefix: str = "s") -> list[dict]:
    """Synthetic samples of varying length with a persistent outlier channel, like LLM residuals."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = 3 + (i * 5) % 11
        aux = torch.randn(t, 3 * hidden, generator=g)
        aux[:, 5] *= 40.0
        final = torch.randn(t, hidden, generator=g) * 3.0
        out.append(
            {
                "sample_id": f"{prefix}{i}",
                "input_ids": torch.randint(0, 150_000, (t,), generator=g),
                "loss_mask": torch.rand(t, generator=g) > 0.3,
                "aux_hidden": aux,
                "final_hidden": final,
            }
        )
    return out


def make_writer(path, encoding="bf16", **kw) -> HiddenStateWriter:
    args = dict(
        target_id="qwen3-8b",
        config_hash="abc123",
        aux_layer_ids=AUX,
        hidden_size=H,
        encoding=encoding,
        samples_per_shard=3,
    )
    args.update(kw)
    return HiddenStateWriter(path, **args)


def add_all(writer: HiddenStateWriter, samples: list[dict]) -> None:
    for s in samples:
        writer.add(s["sample_id"], s["input_ids"], s["loss_mask"], s["aux_hidden"], s["final_hidden"])


def write_store(path, samples, encoding="bf16", **kw) -> Path:
    with make_writer(path, encoding, **kw) as w:
        add_all(w, samples)
    return finalize_store(path)


def store_files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if not p.name.startswith(".lock-")}


def test_bf16_roundtrip_is_exact_bf16_cast(tmp_path):
    samples = make_samples(8)
    write_store(tmp_path, samples)
    store = HiddenStateStore(
        tmp_path, dtype=torch.float32, target_id="qwen3-8b", config_hash="abc123", aux_layer_ids=AUX, hidden_size=H
    )
    assert len(store) == 8
    assert store.num_tokens == sum(s["input_ids"].numel() for s in samples)
    assert [s.num_samples for s in store.shards] == [3, 3, 2]
    assert store.lengths() == [s["input_ids"].numel() for s in samples]
    for i in (7, 0, 4, -1):  # random access, across shard boundaries
        got, want = store[i], samples[i]
        assert got["sample_id"] == want["sample_id"]
        assert got["input_ids"].dtype == torch.int64 and torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(got["loss_mask"], want["loss_mask"])
        for name in ("aux_hidden", "final_hidden"):
            assert torch.equal(got[name], want[name].to(torch.bfloat16).float())
    with pytest.raises(IndexError):
        store[8]


def test_int8_error_bound_and_exact_outliers():
    x = torch.randn(50, 3 * 64) * torch.tensor([0.1, 2.0, 8.0]).repeat_interleave(64)
    x[:, 7] = 500.0  # massive activation in layer 0
    x[:, 64 + 3] *= 60.0  # outlier channel in layer 1
    k = 2
    enc = quantize_int8(x, groups=3, outliers_per_token=k)
    deq = dequantize_int8(enc, torch.float32)
    xg, dg = x.reshape(50, 3, 64), deq.reshape(50, 3, 64)
    # Bound from the largest value *after* removing the k outliers: it fails if outliers set the step.
    residual_absmax = xg.abs().sort(dim=-1, descending=True).values[..., k]
    err = (xg - dg).abs()
    top = xg.abs().topk(k, dim=-1).indices
    is_outlier = torch.zeros_like(xg, dtype=torch.bool).scatter_(-1, top, True)
    bound = (residual_absmax / 127 / 2).unsqueeze(-1) * (1 + 1e-5) + 1e-7
    assert bool((err[~is_outlier] <= bound.expand_as(err)[~is_outlier]).all())
    assert torch.equal(dg[is_outlier], xg[is_outlier].to(torch.bfloat16).float())
    # Layer 0's bulk (sigma 0.1) keeps fine resolution despite the 500.0 channel.
    assert err[:, 0][~is_outlier[:, 0]].max() < 0.01


def test_int8_store_matches_in_memory_roundtrip_and_halves_bytes(tmp_path):
    samples = make_samples(7, seed=1)
    config = HiddenStateStoreConfig(store_dir=str(tmp_path), encoding="int8", samples_per_shard=3)
    with open_writer(config, target_id="t", config_hash="h", aux_layer_ids=AUX, hidden_size=H) as w:
        add_all(w, samples)
    finalize_store(tmp_path)
    # The shard is a standard safetensors file: the library's own full loader accepts it.
    tensors = load_file(str(tmp_path / w.completed_shards[0].file))
    assert tensors["aux_hidden.zstd"].dtype == torch.uint8 and tensors["input_ids"].dtype == torch.int32
    assert tensors["aux_hidden.scale"].shape == (sum(s["input_ids"].numel() for s in samples[:3]), 3)
    store = open_store(config, target_id="t", dtype=torch.float32)
    for i, want in enumerate(samples):
        got = store[i]
        assert torch.equal(got["aux_hidden"], roundtrip(want["aux_hidden"], 3, "int8"))
        assert torch.equal(got["final_hidden"], roundtrip(want["final_hidden"], 1, "int8"))
        assert torch.equal(got["input_ids"], want["input_ids"])
    # Raw mode hands int8 parts over for dequantizing on the device; same values.
    raw = HiddenStateStore(tmp_path, dequantize=False)[2]["aux_hidden"]
    assert raw.q.dtype == torch.int8 and raw.scale.shape == (samples[2]["input_ids"].numel(), 3)
    assert torch.equal(dequantize_int8(raw.to("cpu"), torch.float32), roundtrip(samples[2]["aux_hidden"], 3, "int8"))


def test_int8_is_at_most_half_of_specforge_bytes_per_token(tmp_path):
    hidden = 1024
    g = torch.Generator().manual_seed(3)
    with make_writer(tmp_path, "int8", hidden_size=hidden, samples_per_shard=4) as w:
        for i in range(4):
            t = 128
            w.add(
                f"x{i}",
                torch.randint(0, 1000, (t,), generator=g),
                torch.ones(t, dtype=torch.bool),
                torch.randn(t, 3 * hidden, generator=g),
                torch.randn(t, hidden, generator=g),
            )
    manifest = json.loads(finalize_store(tmp_path).read_text())
    real_bytes = sum(p.stat().st_size for p in tmp_path.glob("shard-*"))
    assert manifest["num_bytes"] == real_bytes
    bytes_per_token = real_bytes / manifest["num_tokens"]
    # SpecForge: 3*Ht + Ht bf16 values per token. Gaussian data is near the worst case for zstd.
    assert bytes_per_token <= 0.5 * 8 * hidden
    assert bytes_per_token > 0.4 * 8 * hidden  # zstd cannot squeeze gaussian int8 much further
    assert estimate_store_bytes(manifest["num_tokens"], hidden, "int8", num_samples=4) >= real_bytes


@pytest.mark.parametrize("encoding", ["bf16", "int8"])
def test_killed_and_resumed_run_is_byte_identical(tmp_path, encoding):
    samples = make_samples(11, seed=2)
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    write_store(clean, samples, encoding)

    with pytest.raises(KeyboardInterrupt):
        with make_writer(killed, encoding) as w:
            add_all(w, samples[:7])  # two complete shards, one sample queued
            raise KeyboardInterrupt
    tag = w.tag
    # What a kill during the third shard's write leaves: a partial shard and a temp file.
    (killed / hss.shard_name(tag, 2)).write_bytes(b"\x00" * 100)
    (killed / f".{hss.shard_name(tag, 3)}.k9_x1z2q.tmp").write_bytes(b"junk")  # atomic_path's temp name

    with make_writer(killed, encoding) as w:
        assert [s.index for s in w.completed_shards] == [0, 1]
        done = w.completed_sample_ids()
        assert done == {s["sample_id"] for s in samples[:6]}
        add_all(w, [s for s in samples if s["sample_id"] not in done])
    finalize_store(killed)
    assert store_files(killed) == store_files(clean)

    # A rerun over a finished store writes nothing new and changes no byte.
    with make_writer(killed, encoding) as w:
        assert len(w.completed_sample_ids()) == len(samples)
    finalize_store(killed)
    assert store_files(killed) == store_files(clean)


def test_corrupt_shard_is_detected_and_named(tmp_path):
    write_store(tmp_path, make_samples(6))
    bad = tmp_path / hss.shard_name(hss.writer_tag(0, 1), 1)
    data = bytearray(bad.read_bytes())
    data[-10] ^= 0xFF
    bad.write_bytes(bytes(data))
    store = HiddenStateStore(tmp_path)
    assert store[0]["sample_id"] == "s0"  # shard 0 is fine
    with pytest.raises(CorruptShardError, match=bad.name):
        store[3]
    # Skipping verification reads the flipped byte without complaint: the check is what caught it.
    assert HiddenStateStore(tmp_path, verify_sha256=False)[3]["sample_id"] == "s3"
    # Truncation is caught by the size check even without hashing.
    bad.write_bytes(bytes(data[:-1]))
    with pytest.raises(CorruptShardError, match=bad.name):
        HiddenStateStore(tmp_path, verify_sha256=False)[3]


def test_prefetch_iterator_follows_order_and_reraises(tmp_path):
    samples = make_samples(9)
    write_store(tmp_path, samples)
    store = HiddenStateStore(tmp_path)
    order = list(itertools.islice(rank_indices(len(store), 0, 2, dp_rank=1, dp_size=2, seed=5, shuffle=True), 4))
    assert [s["sample_id"] for s in store.iter_samples(order, prefetch=2)] == [f"s{i}" for i in order]
    assert [s["sample_id"] for s in store.iter_samples(order[::-1], prefetch=3, workers=2)] == [
        f"s{i}" for i in order[::-1]
    ]
    threads_before = threading.active_count()
    it = store.iter_samples(prefetch=1)
    next(it)
    it.close()  # an abandoned iterator stops its prefetch thread
    assert threading.active_count() == threads_before
    shard = tmp_path / store.shards[2].file
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CorruptShardError, match=shard.name):
        list(HiddenStateStore(tmp_path).iter_samples(prefetch=2))


def test_concurrent_ranks_merge(tmp_path):
    samples = make_samples(10)
    writers = [make_writer(tmp_path, "int8", rank=r, world_size=2) for r in range(2)]
    with pytest.raises(RuntimeError, match="another process"):
        make_writer(tmp_path, "int8", rank=1, world_size=2)
    threads = [threading.Thread(target=add_all, args=(w, samples[r::2])) for r, w in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writers[0].close()
    with pytest.raises(RuntimeError, match="not complete"):
        finalize_store(tmp_path)
    writers[1].close()
    manifest = json.loads(finalize_store(tmp_path).read_text())
    assert manifest["num_samples"] == 10
    assert manifest["writers"] == [hss.writer_tag(0, 2), hss.writer_tag(1, 2)]
    store = HiddenStateStore(tmp_path, dtype=torch.float32)
    by_id = {s["sample_id"]: s for s in samples}
    got = [store[i] for i in range(len(store))]
    assert sorted(g["sample_id"] for g in got) == sorted(by_id)
    for g in got:
        assert torch.equal(g["final_hidden"], roundtrip(by_id[g["sample_id"]]["final_hidden"], 1, "int8"))


def test_finalize_refuses_missing_rank_and_duplicate_ids(tmp_path):
    with make_writer(tmp_path / "a", rank=0, world_size=2) as w:
        add_all(w, make_samples(2))
    with pytest.raises(RuntimeError, match=r"ranks \[1\]"):
        finalize_store(tmp_path / "a")
    with make_writer(tmp_path / "a", rank=1, world_size=2) as w:
        add_all(w, make_samples(2))  # same ids as rank 0
    with pytest.raises(StoreMismatchError, match="'s0'"):
        finalize_store(tmp_path / "a")


def test_manifest_mismatch_errors(tmp_path):
    write_store(tmp_path, make_samples(3))
    with pytest.raises(StoreMismatchError, match="target_id is 'qwen3-8b', expected 'llama-70b'"):
        HiddenStateStore(tmp_path, target_id="llama-70b")
    with pytest.raises(StoreMismatchError, match="aux_layer_ids"):
        HiddenStateStore(tmp_path, aux_layer_ids=(1, 17, 32))
    with pytest.raises(StoreMismatchError, match="encoding"):
        make_writer(tmp_path, "int8")
    with pytest.raises(StoreMismatchError, match="config_hash"):
        make_writer(tmp_path, rank=1, world_size=2, config_hash="other")
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="finalize_store"):
        HiddenStateStore(tmp_path)


def test_writer_rejects_bad_samples(tmp_path):
    s = make_samples(1)[0]
    with make_writer(tmp_path) as w:
        with pytest.raises(ValueError, match="aux_hidden has shape"):
            w.add("a", s["input_ids"], s["loss_mask"], s["final_hidden"], s["final_hidden"])
        bad = s["final_hidden"].clone()
        bad[0, 0] = float("nan")
        with pytest.raises(ValueError, match="finite"):
            w.add("a", s["input_ids"], s["loss_mask"], s["aux_hidden"], bad)
        w.add("a", s["input_ids"], s["loss_mask"], s["aux_hidden"], s["final_hidden"])
        with pytest.raises(ValueError, match="already written"):
            w.add("a", s["input_ids"], s["loss_mask"], s["aux_hidden"], s["final_hidden"])


def test_free_disk_refusal(tmp_path, monkeypatch):
    gib = 1 << 30
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(hss.format.shutil, "disk_usage", lambda p: usage(10 * gib, 9 * gib, gib))
    with pytest.raises(InsufficientDiskError, match=r"needs about 2\.00 GiB but only 1\.00 GiB"):
        check_free_disk(tmp_path / "not" / "yet", 2 * gib)
    assert check_free_disk(tmp_path / "not" / "yet", gib // 2) == gib


def test_estimate_store_bytes_bounds_real_stores(tmp_path):
    # SpecForge's 8*Ht bytes/token plus ids and mask, nothing else, for bf16.
    assert estimate_store_bytes(1000, 4096, "bf16") == 1000 * (8 * 4096 + 5) + 4096
    assert estimate_store_bytes(1000, 4096, "int8") < 0.52 * estimate_store_bytes(1000, 4096, "bf16")
    for encoding in ("bf16", "int8"):
        samples = make_samples(5)
        write_store(tmp_path / encoding, samples, encoding)
        manifest = json.loads((tmp_path / encoding / "manifest.json").read_text())
        est = estimate_store_bytes(manifest["num_tokens"], H, encoding, num_samples=5)
        assert manifest["num_bytes"] <= est < 1.3 * manifest["num_bytes"]


def test_loss_delta_under_encoding():
    samples = make_samples(4, hidden=64)
    weights = torch.randn(64, 100, generator=torch.Generator().manual_seed(0))

    def soft_ce(sample):
        target = torch.softmax(sample["final_hidden"] @ weights / 8, -1)
        draft = torch.log_softmax(sample["aux_hidden"][:, :64] @ weights / 8, -1)  # layer with the x40 channel
        return -(target * draft).sum(-1).mean()

    exact = sum(float(soft_ce(s)) for s in samples) / 4
    d8 = loss_delta_under_encoding(soft_ce, samples, "int8")
    assert d8.exact_loss == pytest.approx(exact)
    assert d8.relative_change == pytest.approx((d8.encoded_loss - exact) / exact)
    assert 0 < abs(d8.relative_change) < 0.01
    assert d8.max_sample_relative_change >= abs(d8.relative_change) * 0.999
    # A loss of 1 + squared error against the exact states makes the relative change the MSE.
    exact_by_id = {s["sample_id"]: s["aux_hidden"] for s in samples}

    def one_plus_mse(sample):
        return 1 + (sample["aux_hidden"] - exact_by_id[sample["sample_id"]]).pow(2).mean().double()

    mse8 = loss_delta_under_encoding(one_plus_mse, samples, "int8").relative_change
    mse0 = loss_delta_under_encoding(one_plus_mse, samples, "int8", outliers_per_token=0).relative_change
    mse_bf16 = loss_delta_under_encoding(one_plus_mse, samples, "bf16").relative_change
    assert mse_bf16 == pytest.approx(
        sum(float((x - x.bfloat16().float()).pow(2).mean()) for x in exact_by_id.values()) / 4, rel=1e-3
    )
    # Without exact outliers the x40 channel sets the int8 step and the error grows by ~40^2.
    assert mse0 > 100 * mse8 > 0
    # Samples with no counted token (loss 0) leave nothing to compare: one clear error, not a ZeroDivisionError.
    with pytest.raises(ValueError, match="exact loss is 0 on all 4 samples"):
        loss_delta_under_encoding(lambda sample: torch.zeros(()), samples, "int8")


@pytest.mark.parametrize("encoding", ["bf16", "int8"])
def test_threaded_writer_is_byte_identical_and_copies_inputs(tmp_path, encoding):
    # bf16 and int32 inputs, as extraction hands them over: no dtype cast makes a copy by accident.
    samples = [
        {
            **s,
            "input_ids": s["input_ids"].int(),
            "aux_hidden": s["aux_hidden"].bfloat16(),
            "final_hidden": s["final_hidden"].bfloat16(),
        }
        for s in make_samples(8, seed=4)
    ]
    write_store(tmp_path / "inline", samples, encoding)
    with make_writer(tmp_path / "threaded", encoding, threads=2) as w:
        for s in samples:
            buffers = {k: v.clone() for k, v in s.items() if k != "sample_id"}
            w.add(
                s["sample_id"],
                buffers["input_ids"],
                buffers["loss_mask"],
                buffers["aux_hidden"],
                buffers["final_hidden"],
            )
            for v in buffers.values():  # an extractor reusing its buffers must not change what is stored
                v.zero_()
    finalize_store(tmp_path / "threaded")
    assert store_files(tmp_path / "threaded") == store_files(tmp_path / "inline")


_RANK_SCRIPT = """
import sys, torch
from megatron_osprey.data.hidden_state_store import HiddenStateWriter
store, rank = sys.argv[1], int(sys.argv[2])
g = torch.Generator().manual_seed(rank)
with HiddenStateWriter(store, target_id="t", config_hash="h", aux_layer_ids=(1, 2, 3), hidden_size=16,
                       encoding="int8", samples_per_shard=2, rank=rank, world_size=2) as w:
    for i in range(rank, 12, 2):
        w.add(f"id{i}", torch.full((4 + i,), i), torch.ones(4 + i, dtype=torch.bool),
              torch.randn(4 + i, 48, generator=g), torch.full((4 + i, 16), float(i)))
"""


def test_two_processes_write_one_store(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    store = tmp_path / "store"
    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    procs = [
        subprocess.Popen([sys.executable, str(script), str(store), str(r)], env=env, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    manifest = json.loads(finalize_store(store).read_text())
    assert manifest["num_samples"] == 12 and len(manifest["shards"]) == 6
    got = {s["sample_id"]: s for s in HiddenStateStore(store, dtype=torch.float32)}
    assert sorted(got) == sorted(f"id{i}" for i in range(12))
    for i in range(12):
        assert got[f"id{i}"]["input_ids"].tolist() == [i] * (4 + i)
        # Constant rows quantize exactly (all channels equal the absmax, or are outliers).
        assert torch.equal(got[f"id{i}"]["final_hidden"], torch.full((4 + i, 16), float(i)))


def test_add_batch_and_pickled_reader(tmp_path):
    import pickle

    samples = make_samples(4, seed=6)
    width = max(s["input_ids"].numel() for s in samples)

    def pad(name, value=0):
        rows = []
        for s in samples:
            x = s[name]
            rows.append(torch.cat([x, torch.full((width - x.shape[0], *x.shape[1:]), value, dtype=x.dtype)]))
        return torch.stack(rows)

    with make_writer(tmp_path) as w:
        w.add_batch(
            [s["sample_id"] for s in samples],
            pad("input_ids"),
            pad("loss_mask", False),
            pad("aux_hidden", 9.0),
            pad("final_hidden", 9.0),
            [s["input_ids"].numel() for s in samples],
        )
    finalize_store(tmp_path)
    store = HiddenStateStore(tmp_path, dtype=torch.float32)
    store[0]  # opens a handle, which pickling must leave behind
    clone = pickle.loads(pickle.dumps(store))
    for i, want in enumerate(samples):
        got = clone[i]
        assert torch.equal(got["input_ids"], want["input_ids"])  # padding was cut off
        assert torch.equal(got["final_hidden"], want["final_hidden"].bfloat16().float())


@pytest.mark.parametrize("name", ["../outside/evil.safetensors", "/etc/passwd", "link.safetensors"])
def test_manifest_paths_outside_the_store_are_refused(tmp_path, name):
    store = tmp_path / "store"
    write_store(store, make_samples(3))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "evil.safetensors").write_bytes((store / hss.shard_name(hss.writer_tag(0, 1), 0)).read_bytes())
    (store / "link.safetensors").symlink_to(outside / "evil.safetensors")
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["shards"][0]["file"] = name
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreMismatchError, match="refusing it|not a plain file name"):
        HiddenStateStore(store, verify_sha256=False)
    # The writers' parts are read by finalize_store: the same check applies there.
    part = next(store.glob("manifest.part-*.json"))
    data = json.loads(part.read_text())
    data["shards"][0]["file"] = name
    part.write_text(json.dumps(data))
    with pytest.raises(StoreMismatchError, match="refusing it|not a plain file name"):
        finalize_store(store)
