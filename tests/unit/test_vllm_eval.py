"""evaluate --engine vllm without the engine: /metrics parsing, the lossless comparison, the agreement check, the
export format chosen per drafter kind, and the results.json section a (scripted) server run produces."""

import contextlib
import json
import re
from types import SimpleNamespace

import pytest
import torch

from megatron_osprey.eval import vllm_engine
from megatron_osprey.eval.config import DrafterSpec
from megatron_osprey.eval.prompts import EvalPrompt
from megatron_osprey.eval.vllm_metrics import (
    SpecCounters,
    agreement_failures,
    lossless_mismatches,
    parse_spec_counters,
    reference_round_al,
    vllm_markdown,
)
from megatron_osprey.export import layouts
from megatron_osprey.models.drafter.reference import DrafterConfig, ReferenceDrafter
from megatron_osprey.stages.evaluate import main as evaluate_main

# What vLLM 0.32's /metrics serves (prometheus_client text: HELP/TYPE lines, a _created sample per counter,
# labels for the engine and the model, one per-position series per draft position).
METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="d"} 40.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="d"} 1.7e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="d"} 200.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="d"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="d",position="0"} 18.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="d",position="1"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="d",position="2"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="d",position="3"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="d",position="4"} 0.0
vllm:num_requests_running{engine="0",model_name="d"} 0.0
"""


def test_metrics_text_gives_acceptance_length_and_per_position_acceptance():
    counters = parse_spec_counters(METRICS)
    assert (counters.drafts, counters.draft_tokens, counters.accepted) == (40.0, 200.0, 30.0)
    assert counters.per_position == (18.0, 8.0, 3.0, 1.0, 0.0)
    assert counters.acceptance_length() == pytest.approx(1 + 30 / 40)
    assert counters.position_acceptance() == pytest.approx([0.45, 0.2, 0.075, 0.025, 0.0])


def test_a_run_is_the_difference_of_the_counters_around_it_summed_over_engines():
    before = parse_spec_counters(METRICS)
    second_engine = METRICS.replace('engine="0"', 'engine="1"')
    after = parse_spec_counters(METRICS + second_engine.replace("40.0", "50.0").replace("30.0", "35.0"))
    run = after - before
    assert (run.drafts, run.accepted) == (50.0, 35.0)
    assert run.per_position == (18.0, 8.0, 3.0, 1.0, 0.0)
    assert run.acceptance_length() == pytest.approx(1.7)
    assert (before + run) == after
    assert parse_spec_counters("# nothing\n").acceptance_length() is None  # a target-only server: no rounds
    with pytest.raises(ValueError, match="position"):
        parse_spec_counters('vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0"} 1.0\n')


def test_lossless_comparison_names_the_first_differing_token():
    expected = {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8]}
    assert lossless_mismatches({"a": [1, 2, 3]}, expected) == []
    assert lossless_mismatches({"a": [1, 9, 3], "b": [4, 5, 6], "c": [7, 8, 2]}, expected) == [
        {"id": "a", "index": 1},
        {"id": "c", "index": 2},  # a longer reply differs where the shorter one ended
    ]
    with pytest.raises(ValueError, match="'z'"):
        lossless_mismatches({"z": [1]}, expected)


def test_reference_round_al_is_tokens_per_verify_round_after_prefill():
    requests = [{"accept_lengths": [1, 3, 2]}, {"accept_lengths": [1, 1]}]
    assert reference_round_al(requests) == pytest.approx(8 / 5)
    assert reference_round_al([{"accept_lengths": []}]) is None


def test_a_mis_served_drafter_fails_the_agreement_check_in_one_sentence_naming_it():
    drafters = {
        "eagle3_chat": {"acceptance_length": 1.151, "reference_acceptance_length": 1.143},
        "osprey_chat": {"acceptance_length": 1.002, "reference_acceptance_length": 1.31},
    }
    failures = agreement_failures(drafters, tolerance=0.04)
    assert len(failures) == 1
    assert failures[0].startswith("drafter osprey_chat ") and "1.002" in failures[0] and "1.310" in failures[0]
    assert failures[0].count(".") >= 1 and failures[0].endswith(".") and "\n" not in failures[0]
    assert agreement_failures(drafters, tolerance=0.5) == []
    # The more a drafter accepts, the more near-ties flip: the allowed gap grows with the reference's AL - 1 ...
    strong = {"osprey_qwen3": {"acceptance_length": 3.55, "reference_acceptance_length": 3.69}}
    assert agreement_failures(strong, tolerance=0.04) == []
    # ... and a strong drafter served wrongly (AL near 1) still fails.
    strong["osprey_qwen3"]["acceptance_length"] = 1.05
    assert agreement_failures(strong, tolerance=0.04)[0].startswith("drafter osprey_qwen3 ")


def _config(variant: str, layers: int, qk: bool = False) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=32,
        target_hidden_size=24,
        num_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=120,
        draft_vocab_size=90,
        qk_layernorm=qk,
        aux_layer_ids=[1, 3, 5],
        variant=variant,
    )


def test_every_drafter_is_served_from_the_vllm_export_whose_layout_follows_its_kind():
    # Not the SGLang layout, whose aux layer ids vLLM reads one layer too shallow.
    assert vllm_engine.VLLM_FORMAT == "vllm"
    assert layouts.vllm_uses_stock(_config("eagle3", 1))  # stock Eagle3LlamaForCausalLM: vLLM's own class
    assert not layouts.vllm_uses_stock(_config("osprey", 2, qk=True))  # this package's plugin
    assert layouts.vllm_aux_layer_ids(_config("eagle3", 1)) == [2, 4, 6]
    assert layouts.vllm_refusal(_config("eagle3", 1)) is None


class ScriptedServer:
    """A stand-in for one vLLM server: greedy replies per prompt, counters that advance per request."""

    def __init__(self, replies: dict, accepted_per_request: tuple[int, int] | None):
        self.replies, self.per_request = replies, accepted_per_request
        self.counters_now = SpecCounters(per_position=(0.0,) * 5)

    def complete(self, prompt_ids, max_tokens, stop_ids):
        if self.per_request:
            rounds, accepted = self.per_request
            self.counters_now = self.counters_now + SpecCounters(rounds, 5 * rounds, accepted, (accepted, 0, 0, 0, 0))
        return list(self.replies[tuple(prompt_ids)])[:max_tokens]

    def counters(self):
        return self.counters_now


def test_the_vllm_section_of_results_json(tmp_path, monkeypatch):
    """Target-only and one EAGLE-3 drafter, scripted: lossless per concurrency, AL from counter deltas beside the
    reference engine's, speedups, and the agreement verdict; the markdown table has every row."""
    prompts = {
        "chat": [EvalPrompt("c0", torch.tensor([1, 2])), EvalPrompt("c1", torch.tensor([3]))],
        "math": [EvalPrompt("m0", torch.tensor([4, 5, 6]))],
    }
    target_replies = {(1, 2): [10, 11, 12, 13], (3,): [20, 21, 22, 23], (4, 5, 6): [30, 31, 32, 33]}
    drafted_replies = {**target_replies, (3,): [20, 21, 99, 23]}  # c1 is served wrongly
    servers = iter([ScriptedServer(target_replies, None), ScriptedServer(drafted_replies, (3, 1))])
    started = []

    @contextlib.contextmanager
    def serve(settings, target, name, speculative_config=None):
        started.append((name, speculative_config))
        yield next(servers)

    monkeypatch.setattr(vllm_engine, "serve", serve)
    monkeypatch.setattr(vllm_engine, "engine_version", lambda engine, python: "0.32.0")
    torch.manual_seed(0)
    drafter = ReferenceDrafter(_config("eagle3", 1)).eval()
    loaded = SimpleNamespace(drafter=drafter, run_config={})
    reference = {
        "cells": [
            {
                "drafter": "e3",
                "split": split,
                "summary": {"mean_acceptance_length": 1.4},
                "requests": [{"id": p.id, "accept_lengths": [2, 1, 1]} for p in ps],
            }
            for split, ps in prompts.items()
        ]
    }
    config = SimpleNamespace(
        output=str(tmp_path),
        vllm_python="python",
        vllm_compile=False,
        vllm_kv_cache_bytes=1 << 30,
        vllm_tensor_parallel_size=1,
        dtype="float32",
        max_new_tokens=4,
        steps=5,
        vllm_concurrency=[1, 4],
        target=str(tmp_path / "target"),
        al_tolerance=0.04,
    )
    section = vllm_engine.evaluate_in_vllm(
        config, reference, prompts, [2], [(DrafterSpec("e3", tmp_path), loaded, "eagle3")], None
    )
    json.dumps(section)  # results.json holds it as it is
    assert [s[0] for s in started] == ["target", "e3"]
    assert started[1][1] == {
        "method": "eagle3",
        "model": str(tmp_path / "vllm" / "exports" / "e3"),
        "num_speculative_tokens": 5,
    }
    assert json.loads((tmp_path / "vllm" / "exports" / "e3" / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLMEagle3"
    ]
    assert section["format"] == vllm_engine.VLLM_TAG
    assert section["engine"]["enforce_eager"] is True and section["engine"]["concurrency"] == [1, 4]
    assert section["engine"]["max_model_len"] == 16  # 3 prompt + 4 new + 6 verify tokens, rounded up to 16
    assert set(section["target_only"]) == {"chat", "math"} and set(section["target_only"]["chat"]) == {"1", "4"}
    d = section["drafters"]["e3"]
    chat = d["splits"]["chat"]
    # c=1 run of chat: 2 requests x (3 rounds, 1 accepted) -> AL 1 + 2/6; the reference: 4 tokens / 3 rounds
    assert chat["acceptance_length"] == pytest.approx(1 + 2 / 6)
    assert chat["reference_acceptance_length"] == pytest.approx(4 / 3)
    assert chat["position_acceptance"] == pytest.approx([2 / 6, 0, 0, 0, 0])
    assert chat["lossless_mismatches"] == [
        {"id": "c1", "index": 2, "concurrency": 1},
        {"id": "c1", "index": 2, "concurrency": 4},
    ]
    assert d["splits"]["math"]["lossless_mismatches"] == []
    assert set(chat["concurrency"]) == {"1", "4"} and chat["concurrency"]["4"]["in_flight"] == 2
    assert chat["concurrency"]["1"]["speedup"] == pytest.approx(
        chat["concurrency"]["1"]["tokens_per_s"] / chat["concurrency"]["1"]["target_only_tokens_per_s"]
    )
    assert d["acceptance_length"] == pytest.approx(1 + 3 / 9) and d["reference_acceptance_length"] == pytest.approx(
        4 / 3
    )
    assert set(d["speedup"]) == {"1", "4"}
    assert section["agreement"] == {"tolerance": 0.04, "failures": []}
    assert [(m["drafter"], m["split"], m["id"]) for m in section["lossless"]["mismatches"]] == [
        ("e3", "chat", "c1")
    ] * 2
    table = vllm_markdown(section)
    assert "| e3 | chat | 1.333 | 1.333 | 2 |" in table and "| e3 | **all** | 1.333 | 1.333 | 2 |" in table
    assert (
        "enforce_eager" in table and "max(0.04, 0.25 x (AL reference - 1))" in table and "every drafter agrees" in table
    )


class ChatServer:
    """A stand-in for one vLLM server that answers every prompt with `answer`, keeps the prompts it was sent, and
    counts 2 draft rounds per request, accepting 1 token on a first turn and 3 on a later one (a longer prompt)."""

    def __init__(self, answer: list[int], first_turn_tokens: int | None):
        self.answer, self.first_turn_tokens, self.sent = answer, first_turn_tokens, []
        self.counters_now = SpecCounters(per_position=(0.0,) * 5)

    def complete(self, prompt_ids, max_tokens, stop_ids):
        self.sent.append(list(prompt_ids))
        if self.first_turn_tokens is not None and max_tokens > 4:  # not the warm-up
            accepted = 1 if len(prompt_ids) <= self.first_turn_tokens else 3
            self.counters_now = self.counters_now + SpecCounters(2, 10, accepted, (accepted, 0, 0, 0, 0))
        return self.answer[:max_tokens]

    def counters(self):
        return self.counters_now


def test_mt_bench_in_vllm_sends_the_second_turn_after_the_first_answer_and_counts_both(tmp_path, monkeypatch):
    """Each conversation's second request is the chat so far (system prompt, question 1, vLLM's answer, question 2)
    through the target's template; both turns are requests of the split, in vLLM's AL as in the reference's."""
    import functools

    from megatron_osprey.data.regenerate.tiny_target import build_tiny_tokenizer
    from megatron_osprey.eval.prompts import follow_up, load_prompts, turn_ids
    from megatron_osprey.eval.suites import MT_BENCH_SYSTEM_PROMPT, write_suite

    tokenizer = build_tiny_tokenizer("qwen3")
    source = tmp_path / "question.jsonl"
    turns = [["Write about cats.", "Now about dogs."], ["Name a color.", "Name another one, please."]]
    source.write_text("".join(json.dumps({"question_id": 81 + i, "turns": t}) + "\n" for i, t in enumerate(turns)))
    write_suite("mtbench", source, tmp_path / "mtbench.jsonl")
    prompts = {"mtbench": load_prompts(tmp_path / "mtbench.jsonl", tokenizer)}
    first_turn_tokens = max(len(p.input_ids) for p in prompts["mtbench"])
    answer = tokenizer("the cat sat", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    servers = [ChatServer(answer, None), ChatServer(answer, first_turn_tokens)]
    feed = iter(servers)

    @contextlib.contextmanager
    def serve(settings, target, name, speculative_config=None):
        yield next(feed)

    monkeypatch.setattr(vllm_engine, "serve", serve)
    monkeypatch.setattr(vllm_engine, "engine_version", lambda engine, python: "0.32.0")
    ids = turn_ids(prompts["mtbench"])
    assert ids == ["mtbench/81", "mtbench/82", "mtbench/81#turn2", "mtbench/82#turn2"]
    # The reference engine: 2 tokens per round on a first turn, 4 on a second.
    requests = [{"id": i, "prompt_tokens": 0, "accept_lengths": [4 if "#" in i else 2] * 2} for i in ids]
    reference = {"cells": [{"drafter": "e3", "split": "mtbench", "summary": {"mean_acceptance_length": 3.0},
                            "requests": requests}]}  # fmt: skip
    config = SimpleNamespace(
        output=str(tmp_path / "out"), vllm_python="python", vllm_compile=False, vllm_kv_cache_bytes=1 << 30,
        vllm_tensor_parallel_size=1, dtype="float32", max_new_tokens=8, steps=5, vllm_concurrency=[1, 2],
        target=str(tmp_path / "target"), al_tolerance=0.04,
    )  # fmt: skip
    loaded = SimpleNamespace(drafter=ReferenceDrafter(_config("eagle3", 1)).eval(), run_config={})
    next_turn = functools.partial(follow_up, tokenizer=tokenizer)
    section = vllm_engine.evaluate_in_vllm(
        config, reference, prompts, [tokenizer.eos_token_id], [(DrafterSpec("e3", tmp_path), loaded, "eagle3")],
        next_turn,
    )  # fmt: skip
    system = {"role": "system", "content": MT_BENCH_SYSTEM_PROMPT}
    said = tokenizer.decode(answer, skip_special_tokens=True)
    for server in servers:
        sent = server.sent[1:]  # after the warm-up: concurrency 1, then 2, each 4 requests
        assert len(sent) == 8
        for run in (sent[:4], sent[4:]):
            for first, second in turns:
                chat = [system, {"role": "user", "content": first}]
                opening = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
                chat += [{"role": "assistant", "content": said}, {"role": "user", "content": second}]
                follow = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
                # Each conversation's second turn carries vLLM's first answer and is sent after that answer.
                assert run.index(follow) > run.index(opening)
                assert len(follow) <= section["engine"]["max_model_len"] - config.max_new_tokens - config.steps - 1
    d = section["drafters"]["e3"]["splits"]["mtbench"]
    # vLLM: 8 rounds, 1 + 1 + 3 + 3 accepted; the reference: 24 tokens in 8 rounds. First turns alone: 1.5 and 2.0.
    assert (d["acceptance_length"], d["reference_acceptance_length"]) == (pytest.approx(2.0), pytest.approx(3.0))
    assert d["lossless_mismatches"] == [] and d["concurrency"]["2"]["in_flight"] == 2
    assert d["concurrency"]["1"]["completion_tokens"] == 4 * len(answer)
    # A reference with only the first turns was measured on other requests.
    cfg = {"steps": 5, "max_new_tokens": 8, "temperature": 0.0}
    full = {**reference, "config": cfg, "splits": [{"name": "mtbench"}]}
    for request, prompt in zip(requests, prompts["mtbench"]):
        request["prompt_tokens"] = len(prompt.input_ids)
    vllm_engine.check_reference(full, "ref.json", config, ["mtbench"], prompts, ["e3"])
    full["cells"][0]["requests"] = requests[:2]
    with pytest.raises(ValueError, match="ref.json: drafter e3 on mtbench was measured on other requests"):
        vllm_engine.check_reference(full, "ref.json", config, ["mtbench"], prompts, ["e3"])


def test_engine_vllm_refuses_sampling_and_a_missing_engine_in_one_line(tmp_path, capsys, monkeypatch):
    data = tmp_path / "chat.jsonl"
    data.write_text("")
    base = [
        "--target",
        str(tmp_path),
        "--drafter",
        f"d={tmp_path}",
        "--data",
        str(data),
        "--output",
        str(tmp_path / "o"),
    ]
    monkeypatch.delenv("VLLM_PYTHON", raising=False)
    missing = str(tmp_path / "no-such-python")
    assert evaluate_main([*base, "--engine", "vllm", "--vllm-python", missing]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: VLLM_PYTHON=") and "make engine-vllm" in err and "\n" not in err
    with pytest.raises(ValueError, match="--temperature 0"):
        vllm_engine.check_engine_request(
            SimpleNamespace(
                temperature=[1.0],
                topk=1,
                draft_tokens=None,
                steps=5,
                replay=False,
                vllm_python="p",
                vllm_concurrency=[1],
            )
        )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"vllm_tensor_parallel_size": 0}, "--vllm-tensor-parallel-size must be 1 or more, got 0"),
        ({"vllm_kv_cache_bytes": 0}, "--vllm-kv-cache-bytes must be positive, got 0"),
        ({"dtype": "float64"}, "got --dtype float64"),
        ({"vllm_concurrency": [1, 0]}, "--vllm-concurrency takes positive integers"),
    ],
)
def test_engine_vllm_refuses_a_server_layout_it_cannot_run(change, message):
    request = dict(
        temperature=[0.0], topk=1, draft_tokens=None, steps=5, replay=False, vllm_python="p", vllm_concurrency=[1],
        vllm_tensor_parallel_size=1, vllm_kv_cache_bytes=None, dtype="float32",
    )  # fmt: skip
    vllm_engine.check_engine_request(SimpleNamespace(**request))
    with pytest.raises(ValueError, match=re.escape(message)):
        vllm_engine.check_engine_request(SimpleNamespace(**{**request, **change}))


def test_the_served_target_follows_the_runs_dtype_and_tensor_parallel_size(tmp_path, monkeypatch):
    """The server line carries --dtype and --tensor-parallel-size; the KV cache is capped on CPU only."""
    seen = {}

    class Server:
        def __init__(self, argv, *args):
            seen["argv"] = argv

        def __enter__(self):
            raise RuntimeError("stop here")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(vllm_engine, "EngineServer", Server)
    settings = vllm_engine.VllmSettings(
        python="/py", repo=tmp_path, log_dir=tmp_path, kv_cache_bytes=None, tensor_parallel_size=4, dtype="bfloat16",
        on_cpu=False,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="stop here"):
        with vllm_engine.serve(settings, tmp_path, "target"):
            pass
    argv = seen["argv"]
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"
    assert "--kv-cache-memory-bytes" not in argv
