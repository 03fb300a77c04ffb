"""The demo's data step: the corpora write the user's files, `osprey data` (a recorded, resumable step) splits
them, and the general pretraining mix leaves out every held-out message it wrote.

Runs the data stage as a subprocess on the Qwen3 tokenizer asset (no model weights); the chat corpus is fetched
once into the corpus cache when it is not there.
"""

from __future__ import annotations

import json

import pytest

from megatron_osprey.data.conversations import read_conversations
from megatron_osprey.demo.pipeline import build_data, read_user_data
from megatron_osprey.demo.sizes import DemoConfig
from megatron_osprey.demo.step_runner import StepRunner


@pytest.fixture(scope="module")
def target():
    from megatron_osprey.assets import get_tokenizer_dir

    try:
        return get_tokenizer_dir("qwen3")
    except Exception as exc:  # noqa: BLE001 - no network and no cache: nothing to test against
        pytest.skip(f"asset tokenizer 'qwen3' could not be fetched: {exc}")


def _norm(text: str) -> str:
    return " ".join(text.split()).casefold()


def test_osprey_data_splits_the_user_files_and_the_mix_leaves_the_held_out_texts_out(tmp_path, target):
    cfg = DemoConfig(train_domains=("code",), eval_domains=("code", "math"), n_train=6, n_eval=2, general_chars=4000)
    data = build_data(StepRunner(tmp_path, total_steps=1), cfg, tmp_path, target)

    record = json.loads((tmp_path / ".steps" / "data.json").read_text())["command"]
    assert record[:3] == ["-m", "megatron_osprey", "data"]  # the job door, its command line recorded
    for domain in ("code", "math"):
        raw = {c.id for c in read_conversations(tmp_path / "data" / "raw" / f"{domain}.jsonl")}
        train = {c.id for c in read_conversations(data["splits"][domain]["train"])}
        held = list(read_conversations(data["splits"][domain]["eval"]))
        assert len(raw) == cfg.n_train + cfg.n_eval and len(train) == cfg.n_train and len(held) == cfg.n_eval
        assert train | {c.id for c in held} == raw and not train & {c.id for c in held}
        assert all(len(c.messages) >= 2 for c in held)  # whole conversations: evaluation prompts with the first
        for c in held:
            for message in c.messages:
                text = _norm(message["content"])
                assert text in data["held_out"]
                for doc in (json.loads(line)["text"] for line in data["general"].read_text().splitlines()):
                    assert text not in _norm(doc) if len(text) >= 20 else text not in map(_norm, doc.splitlines())

    again = StepRunner(tmp_path, total_steps=1)
    assert build_data(again, cfg, tmp_path, target)["splits"] == data["splits"]
    assert set(again.earlier) == {"data"}  # same command: osprey data is not run again


def test_a_training_set_that_osprey_data_shrank_is_refused(tmp_path):
    cfg = DemoConfig(train_domains=("code",), eval_domains=("code",), n_train=6, n_eval=2)
    counts = {"train": 5, "eval": 2, "train_with_eval_prompt_removed": 1}
    (tmp_path / "data_summary.json").write_text(json.dumps({"domains": {"code": counts}}))
    with pytest.raises(RuntimeError, match="osprey data kept 5 training and 2 eval conversations of 'code'"):
        read_user_data(cfg, tmp_path)
    (tmp_path / "data_summary.json").write_text(json.dumps({"domains": {"code": {**counts, "train": 6}}}))
    assert read_user_data(cfg, tmp_path)["code"]["train"] == tmp_path / "prompts" / "code.jsonl"
