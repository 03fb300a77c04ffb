"""Stage 1 (prune): logits of the pruned Megatron and HF outputs, files written, clear errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.base.run_config import load_run_config
from megatron_osprey.models.backbone.gpt import build_gpt_model
from megatron_osprey.models.backbone.prune import prune_backbone, validate
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.stages import prune
from megatron_osprey.stages.prune import PruneConfig
from megatron_osprey.testing.tiny_models import (
    VOCAB,
    causal_logits,
    llama_config,
    make_hf_model,
    qwen3_config,
    truncated_logits,
)
from megatron_osprey.training.checkpointing import load_checkpoint, read_latest_iteration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def parallel():
    with parallel_context(ParallelConfig()) as state:
        yield state


@pytest.mark.parametrize("make_config", [qwen3_config, llama_config], ids=["qwen3_tied", "llama_untied"])
def test_prune_keeps_first_two_layers_exactly(make_config, tmp_path):
    source = tmp_path / "source"
    hf = make_hf_model(make_config(), source)
    (source / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    out = tmp_path / "out"
    # The stage's run: its own process groups, then OUT/megatron, OUT/hf, OUT/run_config.yaml.
    result = prune.run(PruneConfig(source=str(source), output=str(out), num_layers=2))
    assert result.kept_layers == [0, 1]

    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    expected = truncated_logits(hf, ids, num_layers=2)

    # OUT/hf loads in transformers and equals the original's first two layers.
    from transformers import AutoModelForCausalLM

    pruned_hf = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    assert pruned_hf.config.num_hidden_layers == 2
    with torch.no_grad():
        torch.testing.assert_close(pruned_hf(ids).logits, expected, atol=1e-4, rtol=0)
    assert (out / "hf" / "tokenizer_config.json").is_file()
    n_params = sum(p.numel() for p in pruned_hf.parameters())
    assert result.arch.num_parameters() == n_params

    # OUT/megatron is a dist checkpoint that loads into a fresh 2-layer GPTModel.
    arch = ModelArch.from_hf_config(out / "hf")
    with parallel_context(ParallelConfig()) as parallel:
        model = build_gpt_model(arch, parallel.config).eval()
        assert read_latest_iteration(out / "megatron") == 0
        state, _ = load_checkpoint(out / "megatron", model.sharded_state_dict())
        model.load_state_dict(state)
        with torch.no_grad():
            torch.testing.assert_close(causal_logits(model, ids)[..., :VOCAB], expected, atol=1e-4, rtol=0)
    assert load_run_config(out)["kept_layers"] == [0, 1]
    assert load_run_config(out / "megatron" / "iter_0000000")["stage"] == "prune"


def _run_tool(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "prune_backbone.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_tool_errors_name_the_flag(tmp_path):
    source = tmp_path / "source"
    make_hf_model(qwen3_config(), source)
    too_many = _run_tool("--source", source, "--num-layers", 9, "--output", tmp_path / "o")
    assert too_many.returncode == 2
    assert "--num-layers 9 is out of range" in too_many.stderr and "has 4 layers" in too_many.stderr

    missing = _run_tool("--source", tmp_path / "nope", "--num-layers", 2, "--output", tmp_path / "o")
    assert missing.returncode == 2 and "--source" in missing.stderr and "config.json" in missing.stderr

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("precious")
    refused = _run_tool("--source", source, "--num-layers", 2, "--output", taken)
    assert refused.returncode == 2 and "--overwrite" in refused.stderr
    assert (taken / "keep.txt").read_text() == "precious"


def test_validate_rejects_unsupported_architecture_and_missing_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(FileNotFoundError, match=r"--source .*no \*\.safetensors"):
        validate(PruneConfig(source=tmp_path, output=tmp_path / "o"))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="unsupported architecture model_type='mamba'"):
        validate(PruneConfig(source=tmp_path, output=tmp_path / "o"))


def test_importance_strategy_needs_a_gpu(tmp_path, parallel):
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU refusal")
    source = tmp_path / "source"
    make_hf_model(qwen3_config(), source)
    with pytest.raises(RuntimeError, match="--strategy importance .* no CUDA"):
        prune_backbone(PruneConfig(source=source, output=tmp_path / "o", strategy="importance"), parallel)


def test_prune_refuses_a_vocab_size_smaller_than_the_embedding_or_the_tokenizer(tmp_path):
    source = tmp_path / "source"
    make_hf_model(qwen3_config(), source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {"vocab_size": VOCAB - 50}))
    with pytest.raises(ValueError, match=rf"vocab_size {VOCAB - 50} is smaller than the embedding's {VOCAB} rows"):
        validate(PruneConfig(source=source, output=tmp_path / "out"))

    # The embedding fits, but the tokenizer has more ids than the model.
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    (source / "config.json").write_text(json.dumps(config))
    words = {f"w{i}": i for i in range(VOCAB + 20)}
    Tokenizer(WordLevel(words, unk_token="w0")).save(str(source / "tokenizer.json"))
    with pytest.raises(ValueError, match=rf"vocab_size {VOCAB} is smaller than the tokenizer's {VOCAB + 20} tokens"):
        validate(PruneConfig(source=source, output=tmp_path / "out"))
