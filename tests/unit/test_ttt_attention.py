"""The memory-linear TTT attention equals the exact masked one (values, gradients) and its memory is linear in s."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_osprey.base.memory import ttt_attention_bytes, ttt_attention_saved_bytes
from megatron_osprey.models.drafter.ttt_attention import exact_ttt_attention, ttt_attention

ROOT = Path(__file__).resolve().parents[2]


def _inputs(steps, heads, kv_heads, seq, head_dim, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda h: (torch.randn(2, h, seq, head_dim, generator=gen) * 2).to(dtype).requires_grad_()  # noqa: E731
    return make(heads), [make(kv_heads) for _ in range(steps)], [make(kv_heads) for _ in range(steps)]


@pytest.mark.parametrize("steps", [1, 2, 3, 5])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (6, 2, 12), (8, 1, 8)])
def test_linear_attention_equals_exact_values_and_gradients(steps, heads, kv_heads, head_dim):
    query, keys, values = _inputs(steps, heads, kv_heads, 23, head_dim)
    scale = head_dim**-0.5
    fast = ttt_attention(query, keys, values, scale)
    exact = exact_ttt_attention(query, keys, values, scale)
    # Measured: values <= 1e-6, gradients <= 3e-6 (float32).
    torch.testing.assert_close(fast, exact, rtol=0, atol=1e-5)
    upstream = torch.randn_like(fast)
    leaves = [query, *keys, *values]
    grads_fast = torch.autograd.grad((fast * upstream).sum(), leaves)
    grads_exact = torch.autograd.grad((exact * upstream).sum(), leaves)
    for got, want in zip(grads_fast, grads_exact):
        torch.testing.assert_close(got, want, rtol=0, atol=3e-5)


def test_linear_attention_bf16_matches_exact_on_the_same_inputs():
    # The sink score travels in bf16 query channels split into hi + lo parts, so bf16 loses no more
    # than the output's own rounding; compared on the bf16-rounded inputs to isolate the kernel.
    query, keys, values = _inputs(3, 4, 2, 31, 16, seed=1)
    rounded = lambda x: x.detach().bfloat16()  # noqa: E731
    exact = exact_ttt_attention(
        rounded(query).float(), [rounded(k).float() for k in keys], [rounded(v).float() for v in values], 0.25
    )
    fast = ttt_attention(rounded(query), [rounded(k) for k in keys], [rounded(v) for v in values], 0.25)
    assert fast.dtype == torch.bfloat16
    # Measured 3.0e-2 at |out| 6.9: half a bf16 ulp of the output (0.4%).
    torch.testing.assert_close(fast.float(), exact, rtol=1e-2, atol=1e-2)


def test_linear_attention_refuses_mismatched_steps_and_heads():
    query, keys, values = _inputs(2, 4, 2, 5, 8)
    with pytest.raises(ValueError, match="one key and one value tensor per step"):
        ttt_attention(query, keys, values[:1], 1.0)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        ttt_attention(query[:, :3], keys, values, 1.0)


def _benchmark():
    spec = importlib.util.spec_from_file_location(
        "ttt_attention_memory", ROOT / "benchmarks" / "ttt_attention_memory.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_measured_peak_memory_is_linear_in_seq_and_below_the_exact_attention():
    bench = _benchmark()
    args = SimpleNamespace(heads=8, kv_heads=2, head_dim=64, device="cpu", dtype="float32")
    linear = {s: bench.run_child("linear", s, 3, args)["peak_mib"] for s in (1024, 2048, 4096)}
    exact = {s: bench.run_child("exact", s, 3, args)["peak_mib"] for s in (1024, 2048)}
    # Doubling s adds the same again (linear): the second increment is ~2x the first, not ~4x.
    growth = (linear[4096] - linear[2048]) / (linear[2048] - linear[1024])
    assert 1.5 < growth < 2.6, linear
    # The exact attention's K*s^2 scores: measured ~3.8x per doubling, and >10x the linear one at 2048.
    assert exact[2048] / exact[1024] > 3.0, exact
    assert exact[2048] > 8 * linear[2048], (exact, linear)
    # The plan's figure is within 2x of the measured slope (measured 56 KB/token, plan ~47).
    slope = (linear[4096] - linear[2048]) * 2**20 / 2048
    planned = (ttt_attention_bytes(1, 8, 4096, 64, 3, 4, 2) - ttt_attention_bytes(1, 8, 2048, 64, 3, 4, 2)) / 2048
    assert 0.5 < planned / slope < 2.0, (planned, slope)


def _saved_bytes(steps, heads, kv_heads, seq, head_dim, dtype):
    """Bytes of the distinct storages autograd saves for backward over a steps-step unroll, inputs excluded."""
    gen = torch.Generator().manual_seed(0)
    make = lambda h: torch.randn(1, h, seq, head_dim, generator=gen).to(dtype).requires_grad_()  # noqa: E731
    queries = [make(heads) for _ in range(steps)]
    keys, values = [make(kv_heads) for _ in range(steps)], [make(kv_heads) for _ in range(steps)]
    inputs = {t.untyped_storage().data_ptr() for t in queries + keys + values}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in inputs:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = [ttt_attention(queries[k], keys[: k + 1], values[: k + 1], head_dim**-0.5) for k in range(steps)]
    sum(o.float().sum() for o in outs).backward()  # the saved graph is a usable one
    return sum(saved.values())


@pytest.mark.parametrize("steps", [1, 2, 5])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_plan_counts_exactly_what_ttt_attention_saves(steps, heads, kv_heads, head_dim, dtype):
    """In bf16 too: a float32 copy of a bf16 tensor is a new tensor, which the float32 dry run never shows."""
    measured = _saved_bytes(steps, heads, kv_heads, 96, head_dim, dtype)
    planned = ttt_attention_saved_bytes(1, heads, 96, head_dim, steps, dtype.itemsize, kv_heads)
    assert measured == planned
    assert ttt_attention_bytes(1, heads, 96, head_dim, steps, dtype.itemsize, kv_heads) >= planned
