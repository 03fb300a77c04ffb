"""Local `osprey eval` sizes its HF target from config.json at --dtype against the visible memory and refuses,
with the numbers, before any weight (or even the tokenizer) is read."""

import json
from types import SimpleNamespace

import pytest

from megatron_osprey.base.arch import load_target_config
from megatron_osprey.base.memory import GIB, TargetMemoryError, check_eval_target_fits, estimate_eval_target_memory
from megatron_osprey.eval import checks, run

# meta-llama/Llama-3.3-70B-Instruct's published config.json.
LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 8192, "initializer_range": 0.02, "intermediate_size": 28672, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 64, "num_hidden_layers": 80,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.47.0.dev0", "use_cache": True, "vocab_size": 128256,
}  # fmt: skip
LLAMA_70B_PARAMETERS = 70_553_706_496  # the model card's 70.6B, counted from the safetensors index


@pytest.fixture
def target(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    return tmp_path


def _config(target, dtype, device="cuda"):
    return SimpleNamespace(
        target=target, dtype=dtype, device=device, target_backend="hf", max_new_tokens=4096, batch_size=1
    )


@pytest.fixture
def nothing_loaded(monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the refusal must come before anything is read")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def test_the_estimate_counts_the_published_parameters_and_the_kv_cache(target):
    arch = load_target_config(target)
    estimate = estimate_eval_target_memory(arch, "bfloat16", tokens=4096, batch_size=3)
    assert estimate.weight_bytes == LLAMA_70B_PARAMETERS * 2
    layers, kv_heads, head_dim = 80, 8, 128
    assert estimate.activation_bytes == 2 * layers * kv_heads * head_dim * 4096 * 3 * 2
    assert estimate_eval_target_memory(arch, "float32", 4096).weight_bytes == LLAMA_70B_PARAMETERS * 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_70b_target_on_one_80_gib_gpu_is_refused_with_the_numbers(target, dtype, monkeypatch, nothing_loaded):
    monkeypatch.setattr(checks, "visible_memory", lambda device: (80 * GIB, 2048 * GIB))
    with pytest.raises(TargetMemoryError) as refused:
        run._load_target(_config(target, dtype))
    message = str(refused.value)
    width = {"float32": 4, "bfloat16": 2}[dtype]
    assert f"--target {target} " in message and f"--dtype {dtype} " in message
    assert f"weights {LLAMA_70B_PARAMETERS * width / GIB:.1f} GiB" in message and "cuda's memory is 80.0 GiB" in message
    halved = f"pass --dtype bfloat16 ({LLAMA_70B_PARAMETERS * 2 / GIB:.1f} GiB of weights)"
    assert (halved in message) == (dtype == "float32")
    assert "host" not in message  # 2 TiB of host memory holds the weights while they load


def test_on_cpu_the_host_memory_is_the_budget(target, monkeypatch, nothing_loaded):
    monkeypatch.setattr(checks, "visible_memory", lambda device: (24 * GIB, 24 * GIB))
    with pytest.raises(ValueError, match=r"host's available memory is 24\.0 GiB"):
        run._load_target(_config(target, "bfloat16", device="cpu"))


def test_weights_larger_than_the_host_are_refused_even_when_the_gpu_holds_them(target):
    estimate = estimate_eval_target_memory(load_target_config(target), "bfloat16", 4096)
    check_eval_target_fits(estimate, str(target), "bfloat16", "cuda", 192 * GIB, 256 * GIB)  # a B200 fits it
    weights = f"{LLAMA_70B_PARAMETERS * 2 / GIB:.1f}".replace(".", r"\.")
    with pytest.raises(TargetMemoryError, match=rf"weights alone \({weights} GiB\) exceed the host's available 64\.0"):
        check_eval_target_fits(estimate, str(target), "bfloat16", "cuda", 192 * GIB, 64 * GIB)


def test_a_family_the_plan_cannot_size_is_loaded_unchecked(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 768, "n_layer": 12}))
    monkeypatch.setattr(checks, "visible_memory", lambda device: (0, 0))
    assert checks.check_target_fits(_config(tmp_path, "float32"), "cuda") is None


def test_the_megatron_backend_is_sized_too_without_the_host_term(target, monkeypatch, nothing_loaded):
    """--target-backend megatron reads slices straight onto the device: a 70B target on one 80 GiB GPU is refused
    before anything loads, and a small host is no reason to refuse."""
    monkeypatch.setattr(checks, "visible_memory", lambda device: (80 * GIB, 16 * GIB))
    config = _config(target, "bfloat16")
    config.target_backend = "megatron"
    with pytest.raises(TargetMemoryError, match="cuda's memory is 80.0 GiB") as refused:
        run._load_target(config)
    assert "host" not in str(refused.value)


def test_the_megatron_backend_refuses_a_dtype_it_cannot_build(target, nothing_loaded):
    config = _config(target, "float64")
    config.target_backend = "megatron"
    with pytest.raises(ValueError, match="--dtype float64 with --target-backend megatron"):
        run._load_target(config)


def test_a_moe_target_on_cuda_without_te_names_evaluates_own_flags(tmp_path, monkeypatch, nothing_loaded):
    from megatron_osprey.base import hardware
    from megatron_osprey.testing.tiny_models import qwen3_moe_config

    qwen3_moe_config(layers=2).save_pretrained(str(tmp_path))
    monkeypatch.setattr(hardware, "have_transformer_engine", lambda: False)
    config = _config(tmp_path, "bfloat16")
    config.target_backend = "megatron"
    with pytest.raises(ValueError, match="mixture-of-experts .* install it .* or use --target-backend hf") as refused:
        run._load_target(config)
    assert "--transformer-impl" not in str(refused.value)  # evaluate has no such flag


def test_the_megatron_backend_builds_the_target_at_dtype(tmp_path, monkeypatch):
    """--dtype reaches the Megatron target (it was always float32 with the local spec)."""
    from megatron_osprey.models.target import pipeline_stage

    seen = {}

    def load_target(*args, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop")

    monkeypatch.setattr(pipeline_stage, "load_target", load_target)
    config = _config(tmp_path, "bfloat16", device="cpu")
    with pytest.raises(RuntimeError, match="stop"):
        with run._target_factory(config, None):
            pass
    assert seen["params_dtype"] == run.DTYPES["bfloat16"] and "transformer_impl" not in seen  # auto: TE where usable
