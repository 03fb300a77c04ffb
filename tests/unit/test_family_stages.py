"""The stages that decode with a target, run on a tiny random target of each family added after Qwen3 / Llama /
Qwen3-MoE (DeepSeek-V3, GLM-4.5, gpt-oss, Qwen2, Mistral, Gemma 3 text-only and multimodal): regenerate (transformers'
generate), evaluate's reference engine on the transformers and on the Megatron-Core target with --verify-lossless
(and its batched engine and --replay on the transformers one), and the Draft-OPD rollout on both targets.

The evaluation drafts with the target itself plus noise (tests/unit/test_speculative.py's OracleSession), so that
rounds accept some drafts and reject others; the rollout drafts with a random drafter loaded from disk. Three
decoders must agree on every prompt: transformers' generate (the regenerated reply), and the reference engine's
speculative output on each target, which --verify-lossless holds to the engine's own target-only decoding.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_osprey.eval import benchmark
from megatron_osprey.models.drafter.reference import DrafterConfig, ReferenceDrafter
from megatron_osprey.stages import evaluate, regenerate
from megatron_osprey.stages.rollout import RolloutConfig
from megatron_osprey.stages.rollout import run as rollout
from megatron_osprey.testing.tiny_models import write_chat_target, write_conversations_jsonl
from tests.unit.test_speculative import OracleSession

FAMILIES = ["deepseek_v3", "glm4_moe", "gpt_oss", "qwen2", "mistral", "gemma3_text", "gemma3"]
# Draft trees where the target verifies them: sliding windows count rows (every backend), and Megatron-Core's MLA
# applies RoPE by row, so those verify chains only.
WINDOWED = {"gpt_oss", "mistral", "gemma3_text", "gemma3"}
ROW_ROPE = {"deepseek_v3"}
MAX_NEW_TOKENS, PROMPTS = 12, 2


@pytest.fixture(scope="module", params=FAMILIES)
def family_run(request, tmp_path_factory):
    """A family's tiny chat target (transformers' own class, random weights), two prompts, and a random drafter
    sized for it; the HF model too (the oracle drafts with it)."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    model = write_chat_target(root / "target", family).eval()
    config = model.config.get_text_config()
    write_conversations_jsonl(root / "data.jsonl", PROMPTS, seed=3)
    torch.manual_seed(5)
    ReferenceDrafter(
        DrafterConfig(
            hidden_size=32,
            target_hidden_size=config.hidden_size,
            num_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=64,
            vocab_size=config.vocab_size,
            aux_layer_ids=[0, 1, config.num_hidden_layers - 2],
        )
    ).save_pretrained(root / "drafter")
    return family, root, model


def _evaluate(root, out: str, *flags: str) -> dict | int:
    """Evaluate's results.json, or its exit code when that is not 0."""
    code = evaluate.main(
        [
            "--target", str(root / "target"), "--drafter", f"d={root / 'drafter'}", "--data", str(root / "data.jsonl"),
            "--output", str(root / out), "--max-new-tokens", str(MAX_NEW_TOKENS), "--no-progress", *flags,
        ]
    )  # fmt: skip
    return json.loads((root / out / "results.json").read_text()) if code == 0 else code


def _outputs(results: dict) -> dict[str, list[int]]:
    return {r["id"]: r["output_ids"] for cell in results["cells"] for r in cell["requests"]}


def _tree_allowed(family: str, backend: str) -> bool:
    return family not in WINDOWED and not (backend == "megatron" and family in ROW_ROPE)


def test_regenerate_and_the_reference_engine_on_both_targets_give_the_targets_greedy_output(family_run, monkeypatch):
    family, root, model = family_run
    code = regenerate.main(
        ["--input", str(root / "data.jsonl"), "--output", str(root / "regen.jsonl"), "--backend", "hf",
         "--model", str(root / "target"), "--temperature", "0", "--max-tokens", str(MAX_NEW_TOKENS), "--no-progress"]
    )  # fmt: skip
    assert code == 0
    replies = {}
    for line in (root / "regen.jsonl").read_text().splitlines():
        row = json.loads(line)
        replies[row["id"]] = row["conversations"][-1]["content"]
    assert len(replies) == PROMPTS and all(replies.values())

    monkeypatch.setattr(benchmark, "make_session", lambda drafter, *vocab: OracleSession(model, "noisy"))
    outputs = {}
    for backend in ("hf", "megatron"):
        draft = ["--topk", "2", "--draft-tokens", "5"] if _tree_allowed(family, backend) else ["--steps", "3"]
        results = _evaluate(root, f"eval_{backend}", "--verify-lossless", "--target-backend", backend, *draft)
        assert results["lossless"] == {"checked": True, "mismatches": []}
        requests = [r for cell in results["cells"] for r in cell["requests"]]
        outputs[backend] = _outputs(results)
        gains = [a for r in requests for a in r["accept_lengths"]]  # tokens per verify: accepted drafts + 1
        al = sum(r["acceptance_length"] for r in requests) / len(requests)
        print(f"{family} {backend} {' '.join(draft)}: AL {al:.2f}, {sum(gains) - len(gains)} drafts accepted")
        # Some verifies kept drafts and some rejected the first one: both commit paths ran.
        assert max(gains) > 1 and min(gains) == 1
        assert all(len(o) == MAX_NEW_TOKENS for o in outputs[backend].values())
    assert outputs["megatron"] == outputs["hf"]
    # The batched engine and --replay (an explicit mask per forward: windows applied by position) decode the same.
    batched = _evaluate(root, "eval_batched", "--batch-size", "2", "--steps", "3", "--verify-lossless")
    assert batched["lossless"]["mismatches"] == [] and _outputs(batched) == outputs["hf"]
    assert _outputs(_evaluate(root, "eval_replay", "--replay", "--batch-size", "2", "--steps", "3")) == outputs["hf"]
    tokenizer = _tokenizer(root)
    for prompt_id, ids in outputs["megatron"].items():
        assert tokenizer.decode(ids, skip_special_tokens=True) == replies[prompt_id]


def _tokenizer(root):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(root / "target"))


def test_the_rollout_on_the_megatron_target_records_the_hf_rollout(family_run):
    from megatron_osprey.data.hidden_state_store import HiddenStateStore
    from tests.distributed.scripts.check_rollout import compare

    family, root, _ = family_run
    stores = {}
    for backend in ("hf", "megatron"):
        config = RolloutConfig(
            target=str(root / "target"), drafter=str(root / "drafter"), data_path=str(root / "data.jsonl"),
            output=str(root / f"rollout_{backend}"), steps=3, top_k=8, max_new_tokens=MAX_NEW_TOKENS,
            target_backend=backend,
        )  # fmt: skip
        run = rollout(config)
        assert len(run.results) == PROMPTS
        stores[backend] = HiddenStateStore(root / f"rollout_{backend}")
    figures = compare(stores["hf"], stores["megatron"], "megatron")
    print(f"{family} rollout: {figures}")
    assert figures["megatron_samples"] == PROMPTS and figures["megatron_exact"] is True
    assert figures["megatron_rounds"] >= PROMPTS * (MAX_NEW_TOKENS - 1) // 4  # a round gains at most steps + 1
    assert figures["megatron_probs_max_abs"] < 1e-5
    # Both stores round float32 states to bf16: values ~1e-6 apart round at most one quantum apart.
    assert figures["megatron_states_quanta"] <= 1.0


@pytest.mark.parametrize("family_run", ["deepseek_v3"], indirect=True)
def test_a_draft_tree_on_the_megatron_mla_target_is_refused_naming_topk(family_run, capsys):
    """Megatron-Core's MLA applies RoPE by sequence row, not by a tree node's depth: a tree would be verified at
    the wrong positions, so the Megatron-Core DeepSeek-V3 target verifies chains only."""
    _, root, _ = family_run
    assert _evaluate(root, "tree", "--target-backend", "megatron", "--topk", "2", "--draft-tokens", "5") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "multi-latent attention, verifies chains only (--topk 1)" in err[-1]


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    """A 2-layer HF model with its own small chat tokenizer (adapt takes a released, already pruned backbone as is)."""
    from megatron_osprey.testing.distill_setup import write_chat_model

    root = tmp_path_factory.mktemp("backbone")
    return write_chat_model(root / "lm", "llama3", layers=2, hidden=64, seed=2, qwen3=True)


def _adapt(root, backbone, aux: list[int]):
    from megatron_osprey.stages import adapt
    from megatron_osprey.stages.adapt import AdaptConfig

    out = root / f"adapted_{'_'.join(map(str, aux))}"
    adapt.run(AdaptConfig(backbone=str(backbone), target=str(root / "target"), output=str(out), aux_layer_ids=aux))
    return out


@pytest.mark.parametrize("family_run", ["deepseek_v3", "glm4_moe", "gpt_oss"], indirect=True)
def test_the_drafter_of_a_moe_target_exports_to_every_serving_layout(family_run, backbone):
    """The drafter is dense whatever the target: its export reads the target's vocabulary, width and layer count
    only. From the adapt stage's Megatron checkpoint, each layout reads back the reference drafter's weights."""
    from megatron_osprey.export.formats import read_export
    from megatron_osprey.stages.export import main as export_main

    _, root, model = family_run
    config = model.config.get_text_config()
    aux = [0, 1, config.num_hidden_layers - 2]
    adapted = _adapt(root, backbone, aux)
    want = ReferenceDrafter.from_pretrained(adapted / "hf").state_dict()
    for fmt in ("sglang", "vllm", "hf"):
        out = root / f"export_{fmt}"
        assert export_main(["--checkpoint", str(adapted / "megatron"), "--format", fmt, "--output", str(out)]) == 0
        exported = json.loads((out / "config.json").read_text())
        assert exported["target_hidden_size"] == config.hidden_size and exported["vocab_size"] == config.vocab_size
        if fmt == "vllm":  # vLLM counts taps as hidden states after i + 1 layers
            assert exported["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in aux]
        got = (ReferenceDrafter.from_pretrained(out) if fmt == "hf" else read_export(out)).state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("family_run", ["gemma3"], indirect=True)
def test_a_vllm_export_tapping_the_last_layer_of_a_multimodal_target_is_refused(family_run, backbone, capsys):
    """Gemma 3's multimodal config.json keeps its layer count in text_config; the vLLM check reads it there."""
    from megatron_osprey.stages.export import main as export_main

    _, root, model = family_run
    last = model.config.get_text_config().num_hidden_layers - 1
    adapted = _adapt(root, backbone, [0, 1, last])
    flags = ["--checkpoint", str(adapted / "megatron"), "--format", "vllm", "--output", str(root / "export_last")]
    assert export_main(flags) == 2
    assert f"taps the target's last layer ({last})" in capsys.readouterr().err


@pytest.mark.parametrize("family_run", ["deepseek_v3"], indirect=True)
def test_a_kimi_k2_target_decodes_on_megatron_as_deepseek_v3_does_on_transformers(family_run, monkeypatch):
    """Kimi-K2 is DeepSeek-V3 under model_type kimi_k2, which transformers has no class for: the Megatron-Core
    target decodes it (evaluate and rollout) to the tokens and rounds transformers' DeepSeek-V3 gives its weights."""
    import shutil

    from megatron_osprey.data.hidden_state_store import HiddenStateStore
    from tests.distributed.scripts.check_rollout import compare

    _, root, model = family_run
    kimi = root / "kimi"
    shutil.copytree(root / "target", kimi / "target")
    for name in ("drafter", "data.jsonl"):
        (kimi / name).symlink_to(root / name)
    config = json.loads((kimi / "target" / "config.json").read_text())
    (kimi / "target" / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    monkeypatch.setattr(benchmark, "make_session", lambda drafter, *vocab: OracleSession(model, "noisy"))
    flags = ["--steps", "3", "--verify-lossless"]
    want = _evaluate(root, "eval_chain_hf", "--target-backend", "hf", *flags)
    got = _evaluate(kimi, "eval_megatron", "--target-backend", "megatron", *flags)
    assert got["lossless"] == {"checked": True, "mismatches": []} and _outputs(got) == _outputs(want)
    stores = {}
    for name, directory, backend in (("deepseek", root, "hf"), ("kimi", kimi, "megatron")):
        rollout(
            RolloutConfig(
                target=str(directory / "target"), drafter=str(root / "drafter"), data_path=str(root / "data.jsonl"),
                output=str(directory / "rollout_kimi_check"), steps=3, top_k=8, max_new_tokens=MAX_NEW_TOKENS,
                target_backend=backend,
            )
        )  # fmt: skip
        stores[name] = HiddenStateStore(directory / "rollout_kimi_check")
    figures = compare(stores["deepseek"], stores["kimi"], "kimi")
    assert figures["kimi_exact"] is True and figures["kimi_probs_max_abs"] < 1e-5
