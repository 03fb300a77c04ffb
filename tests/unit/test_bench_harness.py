"""The `make bench` harness on tiny inputs: alternation, the row arithmetic, the table, bench.json, the
preprocessing pair's byte-identical check, the SpecForge-style peer's loss, and the distillation and speculative
pairs built by `--quick` and run once on a tiny target. Not the timings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from megatron_osprey.testing.tiny_models import write_byte_level_bpe

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import bench  # noqa: E402
from benchmarks.bench_harness import (  # noqa: E402
    COLUMNS,
    JSON_KEYS,
    Pair,
    Timings,
    format_table,
    make_row,
    run_pair,
    write_json,
)

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "héllo wörld — unicode ✓",
    "short",
] * 5


def test_row_arithmetic_is_peer_over_ours_and_limit_over_ours():
    pair = Pair("s", ours=lambda: None, peer=lambda: None)
    row = make_row(pair, Timings([2.0, 1.0, 3.0]), Timings([5.0, 4.0, 9.0]), 0.5)
    assert row.ours_s == 2.0 and row.peer_s == 5.0  # medians, not means (means: 2.0 and 6.0)
    assert row.ratio == pytest.approx(2.5)
    assert row.share_of_limit == pytest.approx(0.25)
    assert row.ours_spread == pytest.approx(1.0) and row.peer_spread == pytest.approx(1.0)
    assert make_row(pair, Timings([1.0]), Timings([1.0]), None).share_of_limit is None


def test_run_pair_alternates_skips_warmup_and_checks_outputs():
    calls, seen = [], []
    pair = Pair(
        "s",
        ours=lambda: calls.append("o") or "ours-out",
        peer=lambda: calls.append("p") or "peer-out",
        limit=lambda: calls.append("l"),
        check=lambda a, b: seen.append((a, b)),
    )
    row = run_pair(pair, runs=3, warmup=1, say=lambda _: None)
    assert calls == ["o", "p", "l"] * 4
    assert seen == [("ours-out", "peer-out")]
    assert row.runs == 3 and row.limit_s is not None

    def differ(a, b):
        raise AssertionError("outputs differ")

    with pytest.raises(AssertionError, match="differ"):
        run_pair(Pair("s", lambda: 1, lambda: 2, check=differ), runs=1, warmup=0, say=lambda _: None)
    with pytest.raises(ValueError, match="--runs"):
        run_pair(Pair("s", lambda: 1, lambda: 2), runs=0)


def test_run_pair_closes_the_pair_also_when_it_fails():
    closed, quiet = [], lambda _: None

    def fail():
        raise RuntimeError("peer broke")

    run_pair(Pair("s", lambda: 1, lambda: 2, close=lambda: closed.append("ok")), runs=1, warmup=0, say=quiet)
    with pytest.raises(RuntimeError, match="peer broke"):
        run_pair(Pair("s", lambda: 1, fail, close=lambda: closed.append("failed")), runs=1, warmup=0, say=quiet)
    assert closed == ["ok", "failed"]


def test_computed_limit_used_when_no_timed_limit():
    row = run_pair(Pair("s", lambda: 1, lambda: 2, limit_seconds=lambda: 7.5), runs=1, warmup=0, say=lambda _: None)
    assert row.limit_s == 7.5


def test_table_has_the_columns_and_one_line_per_row():
    rows = [
        make_row(Pair("alpha", None, None, peer_name="P1"), Timings([1.0]), Timings([3.0]), 0.5),
        make_row(Pair("beta", None, None, peer_name="P2"), Timings([2.0]), Timings([1.0]), None),
    ]
    lines = format_table(rows).splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == list(COLUMNS)
    alpha = [c.strip() for c in lines[2].strip("|").split("|")]
    assert alpha[0] == "alpha" and alpha[3] == "3.00×" and alpha[5] == "50%"
    beta = [c.strip() for c in lines[3].strip("|").split("|")]
    assert beta[3] == "0.50×" and beta[4] == "—" and beta[5] == "—"
    assert any("peer = P2" in line for line in lines)


def test_main_writes_bench_json_with_the_schema(tmp_path, monkeypatch):
    def fake_build(name, sizes, workdir, bf16):
        assert sizes == bench.Sizes.quick() and bf16 is False  # forced below: no native bf16, float32
        return Pair(name, ours=lambda: None, peer=lambda: None, limit_seconds=lambda: 1.0)

    monkeypatch.setattr(bench, "build_pair", fake_build)
    monkeypatch.setenv("OSPREY_CPU_CAPABILITY", "avx2")
    assert bench.main(["--quick", "--runs", "3", "--output", str(tmp_path), "--only", "preprocessing", "decoding"]) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert [r["stage"] for r in rows] == ["preprocessing", "decoding"]
    for r in rows:
        assert set(JSON_KEYS) <= set(r)
        assert r["ratio"] == pytest.approx(r["peer_s"] / r["ours_s"])
        assert r["share_of_limit"] == pytest.approx(r["limit_s"] / r["ours_s"])
        assert r["runs"] == 3


def test_write_json_is_a_list_of_rows(tmp_path):
    row = make_row(Pair("s", None, None), Timings([1.0]), Timings([2.0]), None)
    path = write_json([row], tmp_path / "sub" / "bench.json")
    assert json.loads(path.read_text())[0]["ratio"] == 2.0


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>"}
    return write_byte_level_bpe(tmp_path_factory.mktemp("tok"), DOCS, 300, ["<eos>"], config)


def test_megatron_style_peer_writes_the_same_bytes_as_ours(tmp_path, tokenizer_dir):
    from benchmarks.bench_preprocess import check_identical, megatron_style_preprocess
    from megatron_osprey.data.preprocess import preprocess
    from megatron_osprey.stages.preprocess import PreprocessConfig

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    ours = preprocess(
        PreprocessConfig(
            input=str(corpus), tokenizer=str(tokenizer_dir), output_prefix=str(tmp_path / "ours"), workers=1
        )
    ).dataset_prefix
    peer = megatron_style_preprocess(str(corpus), str(tokenizer_dir), str(tmp_path / "peer"), workers=2)
    check_identical(ours, peer)
    assert Path(peer + ".bin").stat().st_size > 2 * len(DOCS)  # tokens plus one end-of-document each

    data = bytearray(Path(peer + ".bin").read_bytes())
    data[0] ^= 1
    Path(peer + ".bin").write_bytes(bytes(data))
    with pytest.raises(AssertionError, match="same bytes"):
        check_identical(ours, peer)


def test_specforge_peer_loss_equals_ours_under_the_reference_conventions():
    """The peer's loss (SpecForge's shifts and per-sample normalisation) is ttt_loss with mask_alignment and
    normalization "reference", on the same logits."""
    import torch

    from benchmarks.bench_distill import specforge_targets, specforge_ttt_loss
    from megatron_osprey.losses.config import TTTLossConfig
    from megatron_osprey.losses.ttt import ttt_loss

    generator = torch.Generator().manual_seed(0)
    b, s, vocab, steps = 3, 12, 20, 5
    t2d = torch.rand(vocab, generator=generator) < 0.6
    t2d[:2] = True
    draft = int(t2d.sum())
    target = 3 * torch.randn(b, s, vocab, generator=generator)
    lengths = torch.tensor([12, 9, 5])
    loss_mask = (torch.rand(b, s, generator=generator) < 0.7) & (torch.arange(s)[None] < lengths[:, None])
    logits = [torch.randn(b, s, draft, generator=generator) for _ in range(steps)]

    config = TTTLossConfig(ttt_steps=steps, mask_alignment="reference", normalization="reference")
    in_draft = t2d[target.argmax(-1)]
    ours, _ = ttt_loss(logits, target[..., t2d], loss_mask, in_draft, draft, config, lengths=lengths)
    target_p, position_mask = specforge_targets(target, loss_mask, lengths, t2d)
    peer = specforge_ttt_loss(logits, target_p, position_mask, lengths.float(), config.decay)
    assert float(peer) == pytest.approx(float(ours), rel=1e-5)
    # The predicted-token alignment counts other rows: the comparison above can tell them apart.
    predicted, _ = ttt_loss(
        logits, target[..., t2d], loss_mask, in_draft, draft, TTTLossConfig(normalization="reference"), lengths=lengths
    )
    assert float(predicted) != pytest.approx(float(ours), rel=1e-3)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    """A random 8-layer chat model with a small tokenizer, standing in for SmolLM2 (no download)."""
    from megatron_osprey.testing.distill_setup import write_chat_model

    return write_chat_model(tmp_path_factory.mktemp("target"), "qwen3", layers=8, hidden=64, seed=1)


@pytest.fixture(scope="module")
def quick_workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench")  # shared: the two model pairs share the adapted drafter


@pytest.mark.parametrize("name, bf16", [("distillation", True), ("speculative", True), ("distillation", False)])
def test_quick_model_pairs_build_and_run_once(name, bf16, tiny_target, quick_workdir, tmp_path, monkeypatch):
    """bf16=False: a CPU without native bf16, where both sides of the distillation step compute in float32."""
    import megatron_osprey.assets

    monkeypatch.setattr(megatron_osprey.assets, "get_model_dir", lambda _name: tiny_target)
    pair = bench.build_pair(name, bench.Sizes.quick(), quick_workdir if bf16 else tmp_path, bf16=bf16)
    row = run_pair(pair, runs=1, warmup=0, say=lambda _: None)  # runs the pair's check: same batch / same tokens
    assert row.runs == 1 and row.peer_name
    if name == "distillation":
        assert row.limit_s is not None and row.limit_s > 0 and "GFLOP" in row.limit_name
        dtype = "bf16" if bf16 else "float32"
        assert row.stage.endswith(f"TTT 5, {dtype})") and f"measured {dtype} matmul rate" in row.limit_name
        assert ("bf16 autocast" in row.peer_name) is bf16
        import torch

        assert not torch.distributed.is_initialized()  # the pair's close released the stage's process groups
    else:
        assert row.limit_s is None
        outputs = pair.ours()
        assert [len(r.output_ids) for r in outputs] == [bench.Sizes.quick().spec_tokens] * len(outputs)
