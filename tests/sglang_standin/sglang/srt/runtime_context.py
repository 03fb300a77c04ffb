"""sglang.srt.runtime_context stand-in: one process, no pipeline or tensor parallelism."""

from types import SimpleNamespace


def get_parallel():
    return SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True), tp_size=1, attn_tp_size=1)


def get_spec():
    return SimpleNamespace(speculative_draft_window_size=None)
