"""A target's config.json is read completely: every field that changes the computation is implemented or refused
by name, as one line and exit 2 from `osprey plan` and `extract`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_osprey.base.arch import load_target_config
from megatron_osprey.base.config_fields import FIELDS
from tests.unit.test_target_configs import CASES, LLAMA33_70B_INSTRUCT, QWEN3_8B, SMOLLM2_135M_INSTRUCT

REPO = Path(__file__).resolve().parents[2]

# Every field of the published configs that the forward pass never reads; the rest must be rows of FIELDS.
NOT_COMPUTATION = {
    "architectures", "model_type", "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id",
    "initializer_range", "use_cache", "attention_dropout", "is_llama_config", "rope_interleaved",
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "use_mtp", "num_mtp_modules",
    "mtp_transformer_layers",
}  # fmt: skip

# (case, the config edited as the issue found it, what the one line says)
BAD = [
    ("llama mlp_bias", SMOLLM2_135M_INSTRUCT, {"mlp_bias": True}, r"mlp_bias true is not supported: biases on gate"),
    ("llama attention_bias", SMOLLM2_135M_INSTRUCT, {"attention_bias": True}, r"attention_bias true is not supp"),
    ("gelu", SMOLLM2_135M_INSTRUCT, {"hidden_act": "gelu_pytorch_tanh"},
     r'hidden_act "gelu_pytorch_tanh" is not supported: the MLP is built as SwiGLU'),
    ("qwen3 sliding window", QWEN3_8B, {"use_sliding_window": True, "sliding_window": 4096}, r"use_sliding_window"),
    ("sliding layer_types", QWEN3_8B, {"layer_types": ["full_attention"] * 35 + ["sliding_attention"]}, "layer_types"),
    ("zero heads", SMOLLM2_135M_INSTRUCT, {"num_attention_heads": 0}, r"num_attention_heads 0 must be at least 1"),
    ("32 heads over 7", LLAMA33_70B_INSTRUCT, {"num_attention_heads": 32, "num_key_value_heads": 7},
     r"num_attention_heads 32 is not a multiple of num_key_value_heads 7"),
    ("tie as a string", SMOLLM2_135M_INSTRUCT, {"tie_word_embeddings": "false"},
     r'tie_word_embeddings must be true or false, not "false" \(a string\)\.$'),
    ("a list for an int", SMOLLM2_135M_INSTRUCT, {"num_hidden_layers": [30]},
     r"num_hidden_layers must be an integer, not \[30\] \(a list\)"),
    ("no layer count", SMOLLM2_135M_INSTRUCT, {"num_hidden_layers": None}, r"num_hidden_layers is missing"),
    ("llama3 rope short", LLAMA33_70B_INSTRUCT,
     {"rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                       "rope_type": "llama3"}}, r"rope_scaling\.low_freq_factor is missing; llama3 RoPE"),
    ("hidden not divisible", SMOLLM2_135M_INSTRUCT, {"num_attention_heads": 7, "num_key_value_heads": 7},
     r"hidden_size 576 is not a multiple of num_attention_heads 7"),
    ("dtype", SMOLLM2_135M_INSTRUCT, {"torch_dtype": "int8"}, r'torch_dtype "int8" is not supported' ),
]  # fmt: skip


def _write(tmp_path: Path, config: dict, edits: dict) -> Path:
    config = {k: v for k, v in {**config, **edits}.items() if v is not None or k not in edits}
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(config))
    return tmp_path / "target"


@pytest.mark.parametrize("case, config, edits, message", BAD, ids=[b[0] for b in BAD])
def test_a_field_that_changes_the_computation_is_refused_by_name(tmp_path, case, config, edits, message):
    target = _write(tmp_path, config, edits)
    with pytest.raises(ValueError, match=rf"^{target / 'config.json'}: {message}"):
        load_target_config(target)


def test_every_field_of_the_published_configs_is_a_row_or_known_to_be_inert():
    rows = {field.name for field in FIELDS}
    published = {key for config, _, _ in CASES.values() for key in config}
    assert published - rows - NOT_COMPUTATION == set()
    assert rows & NOT_COMPUTATION == set()
    assert {"mlp_bias", "attention_bias", "hidden_act", "use_sliding_window", "layer_types"} <= rows


def test_a_config_nested_too_deep_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON \(RecursionError"):
        load_target_config(tmp_path)


@pytest.mark.parametrize("case", ["llama mlp_bias", "qwen3 sliding window", "tie as a string"])
def test_osprey_plan_and_extract_say_one_line_and_exit_2(tmp_path, case):
    _, config, edits, message = next(b for b in BAD if b[0] == case)
    target = _write(tmp_path, config, edits)
    data = tmp_path / "conversations.jsonl"
    data.write_text(json.dumps({"id": "a", "conversations": [{"role": "user", "content": "hi"}]}) + "\n")
    plan = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "plan", "qwen3_8b_osprey_distill_2gpu_h100_bf16", "--stage", "distill",
         "--set", f"paths.target={target}"], capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    extract = subprocess.run(
        [sys.executable, "-m", "megatron_osprey.stages.extract", "--target", str(target), "--data", str(data),
         "--output", str(tmp_path / "out")], capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    for done in (plan, extract):
        lines = [line for line in done.stderr.splitlines() if line.startswith(("error:", "osprey: error:"))]
        assert done.returncode == 2, done.stdout + done.stderr
        assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr
        assert "config.json" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
