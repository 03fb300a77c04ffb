"""tools/sglang_bench.py against a fake SGLang /generate on loopback: AL from meta_info, results layout."""

import json
import threading

import pytest

from megatron_osprey.eval.sglang_client import request_record
from tests.fake_sglang import fake_sglang_server, meta_reply
from tools.sglang_bench import main


def test_request_record_uses_completion_tokens_over_spec_verify_ct():
    record = request_record("a", 12, {"completion_tokens": 50, "spec_verify_ct": 20, "finish_reason": "length"}, 2.0)
    assert (record["acceptance_length"], record["tokens_per_s"], record["verify_count"]) == (2.5, 25.0, 20)
    with pytest.raises(ValueError, match="--speculative-algorithm"):
        request_record("a", 12, {"completion_tokens": 50}, 1.0)


def test_bench_tool_against_a_fake_server(tmp_path):
    from megatron_osprey.data.regenerate.tiny_target import build_tiny_tokenizer

    build_tiny_tokenizer("qwen3").save_pretrained(tmp_path / "target")
    seen = []

    def answer(body):
        seen.append(body)
        # Request i: 10 tokens in (i + 2) verifies.
        return meta_reply({"completion_tokens": 10, "spec_verify_ct": len(seen) + 1, "finish_reason": "stop"})

    rows = [{"id": f"r{i}", "conversations": [{"role": "user", "content": f"hi {i}"}]} for i in range(3)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with fake_sglang_server(answer) as url:
        rc = main(
            ["--url", url, "--tokenizer", str(tmp_path / "target"), "--data", str(tmp_path / "chat.jsonl"),
             "--output", str(tmp_path / "out"), "--drafter-name", "d", "--train-domain", "chat",
             "--max-new-tokens", "64", "--wait", "30"]
        )  # fmt: skip
    assert rc == 0
    assert [b["sampling_params"] for b in seen] == [{"temperature": 0.0, "max_new_tokens": 64}] * 3
    assert seen[0]["input_ids"][:1] != [] and isinstance(seen[0]["input_ids"][0], int)
    summary = json.loads((tmp_path / "out" / "results.json").read_text())["cells"][0]["summary"]
    assert summary["mean_acceptance_length"] == pytest.approx((10 / 2 + 10 / 3 + 10 / 4) / 3)
    assert summary["pooled_acceptance_length"] == pytest.approx(30 / 9)
    assert "| chat (d) | **" in (tmp_path / "out" / "matrix.md").read_text()


def test_bench_sweeps_temperature_and_batch_size(tmp_path):
    import time

    from megatron_osprey.data.regenerate.tiny_target import build_tiny_tokenizer

    build_tiny_tokenizer("qwen3").save_pretrained(tmp_path / "target")
    lock, state = threading.Lock(), {"in_flight": 0, "peak": [], "temps": []}

    def answer(body):
        with lock:
            state["in_flight"] += 1
            state["peak"].append((body["sampling_params"]["temperature"], state["in_flight"]))
        time.sleep(0.05)
        with lock:
            state["in_flight"] -= 1
        return meta_reply({"completion_tokens": 12, "spec_verify_ct": 4, "finish_reason": "length"})

    rows = [
        {"id": f"r{i}", "conversations": [{"role": "system", "content": "sys"}, {"role": "user", "content": f"hi {i}"}]}
        for i in range(4)
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with fake_sglang_server(answer) as url:
        rc = main(
            ["--url", url, "--tokenizer", str(tmp_path / "target"), "--data", str(tmp_path / "chat.jsonl"),
             "--output", str(tmp_path / "out"), "--drafter-name", "d", "--train-domain", "chat",
             "--temperature", "0", "1", "--batch-size", "1", "4", "--seed", "3"]
        )  # fmt: skip
    assert rc == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [(r["temperature"], r["batch_size"], r["sampling"]) for r in results["sweep"]] == [
        (0.0, 1, "greedy"),
        (0.0, 4, "greedy"),
        (1.0, 1, "lossless rejection sampling"),
        (1.0, 4, "lossless rejection sampling"),
    ]
    assert results["config"]["max_new_tokens"] == 4096 and results["config"]["prompt_messages"] == "first_user"
    peaks = [p for _, p in state["peak"]]
    assert max(peaks[:4]) == 1 and max(peaks[4:8]) > 1  # batch 1 one at a time, batch 4 concurrently
    for cell in results["cells"]:
        assert cell["summary"]["mean_acceptance_length"] == 3.0 and cell["summary"]["throughput_tokens_per_s"] > 0
    assert (
        "| 1 | None | None | None | 4 | 3 | lossless rejection sampling | osprey |"
        in (tmp_path / "out" / "matrix.md").read_text()
    )


def test_mt_bench_sends_the_second_turn_after_the_servers_first_answer(tmp_path):
    """The release's MT-Bench through the client: conversations side by side (--batch-size 2), each one's second
    request the chat so far with the server's first answer (output_ids) through the target's template, sent after
    that answer; both turns are requests of the split and its AL."""
    import time

    from megatron_osprey.data.regenerate.tiny_target import build_tiny_tokenizer
    from megatron_osprey.eval.suites import MT_BENCH_SYSTEM_PROMPT, write_suite

    tokenizer = build_tiny_tokenizer("qwen3")
    tokenizer.save_pretrained(tmp_path / "target")
    source = tmp_path / "question.jsonl"
    turns = [["Write about cats.", "Now about dogs."], ["Name a color.", "Name another one, please."]]
    source.write_text("".join(json.dumps({"question_id": 81 + i, "turns": t}) + "\n" for i, t in enumerate(turns)))
    write_suite("mtbench", source, tmp_path / "mtbench.jsonl")
    answers = [tokenizer(f"the cat sat {i}", add_special_tokens=False)["input_ids"] for i in range(2)]
    lock, sent, state = threading.Lock(), [], {"in_flight": 0, "peak": 0}

    def answer(body):
        with lock:
            sent.append(body["input_ids"])
            state["in_flight"] += 1
            state["peak"] = max(state["peak"], state["in_flight"])
        time.sleep(0.1)
        with lock:
            state["in_flight"] -= 1
        # Conversation i's first answer is answers[i] (its question names it); a second turn (the prompt holds
        # an answer) takes 6 verifies.
        prompt = tokenizer.decode(body["input_ids"])
        second, index = "cat sat" in prompt, int("color" in prompt)
        meta = {"completion_tokens": 12, "spec_verify_ct": 6 if second else 3, "finish_reason": "stop"}
        return {"text": "?", "output_ids": answers[index] + [tokenizer.eos_token_id], "meta_info": meta}

    with fake_sglang_server(answer) as url:
        rc = main(
            ["--url", url, "--tokenizer", str(tmp_path / "target"), "--data", str(tmp_path / "mtbench.jsonl"),
             "--output", str(tmp_path / "out"), "--drafter-name", "d", "--batch-size", "2"]
        )  # fmt: skip
    assert rc == 0
    system = {"role": "system", "content": MT_BENCH_SYSTEM_PROMPT}
    for (first, second), answer in zip(turns, answers):
        chat = [system, {"role": "user", "content": first}]
        opening = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
        chat += [{"role": "assistant", "content": tokenizer.decode(answer)}, {"role": "user", "content": second}]
        follow = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert sent.index(follow) > sent.index(opening)  # the second turn carries the first answer, after it
    assert len(sent) == 4 and state["peak"] == 2  # the two conversations side by side, each one's turns in turn
    (cell,) = json.loads((tmp_path / "out" / "results.json").read_text())["cells"]
    assert [r["id"] for r in cell["requests"]] == ["mtbench/81", "mtbench/82", "mtbench/81#turn2", "mtbench/82#turn2"]
    # AL per conversation over both turns, as the release's benchmarker counts it: (12 + 12) / (3 + 6) each;
    # per turn 4, 4, 2, 2 (first turns alone: 4).
    assert cell["summary"]["mean_acceptance_length"] == pytest.approx(24 / 9)
    assert cell["summary"]["turn_mean_acceptance_length"] == 3.0
    assert cell["summary"]["pooled_acceptance_length"] == pytest.approx(48 / 18)
