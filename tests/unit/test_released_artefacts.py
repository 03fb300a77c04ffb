"""The release's artefacts load directly: its pruned HF backbone as Stage 3's --backbone."""

import json
import shutil

import pytest
import torch

from megatron_osprey.base.arch import ModelArch
from megatron_osprey.base.run_config import save_run_config
from megatron_osprey.data.conversations import from_user_row, read_conversations
from megatron_osprey.data.regenerate.tiny_target import build_tiny_tokenizer
from megatron_osprey.models.drafter.adapt import adapt_reference_drafter, backbone_hf_dir
from megatron_osprey.stages.adapt import AdaptConfig
from megatron_osprey.testing.tiny_models import make_hf_model, qwen3_config, write_chat_target


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """The same 2-layer Qwen3 backbone as a prune stage writes it (run_config.yaml + hf/) and as the release
    publishes it (a plain HF directory), and a tiny Llama-3 chat target."""
    root = tmp_path_factory.mktemp("released")
    tokenizer = build_tiny_tokenizer("qwen3")
    stage = root / "stage_backbone"
    make_hf_model(qwen3_config(layers=2, vocab=len(tokenizer)), stage / "hf", seed=4)
    tokenizer.save_pretrained(str(stage / "hf"))
    save_run_config(stage / "run_config.yaml", {"stage": "prune", "num_layers": 2})
    released = root / "osprey_backbone"
    shutil.copytree(stage / "hf", released)
    target = root / "target"
    write_chat_target(target, "llama")
    return stage, released, target


def test_the_released_backbone_adapts_as_the_pruned_one(layouts):
    stage, released, target = layouts
    assert not (released / "run_config.yaml").exists() and not (released / "hf").exists()
    assert backbone_hf_dir(released) == released and backbone_hf_dir(stage) == stage / "hf"
    arch = ModelArch.from_hf_config(target)
    results = [
        adapt_reference_drafter(AdaptConfig(backbone=str(d), target=str(target), aux_layer_ids=[1, 2, 3]), arch)
        for d in layouts[:2]
    ]
    from_stage, from_release = results
    assert from_release.arch.body.num_layers == 2  # no second prune: the layers it was published with
    assert from_release.arch == from_stage.arch and from_release.report == from_stage.report
    assert from_stage.report["counts"]["copied"] > 0
    expected = from_stage.drafter.state_dict()
    got = from_release.drafter.state_dict()
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_a_directory_with_neither_layout_is_refused(layouts, tmp_path):
    stage, _, _ = layouts
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(stage / "hf" / "config.json", config_only / "config.json")
    with pytest.raises(ValueError, match="no run_config.yaml .* and no HF config.json with safetensors weights"):
        backbone_hf_dir(config_only)


def release_split_line(**fields):
    """One line shaped like the release's regenerated splits: the source row's keys (id or uuid, lang) kept,
    assistant turns with the server's reasoning_content (null when the parser found none), status added."""
    row = {
        "conversations": [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4.", "reasoning_content": "Two plus two is four."},
            {"role": "user", "content": "And 3 + 3?"},
            {"role": "assistant", "content": "6.", "reasoning_content": None},
        ],
        "lang": "en",
        "status": "success",
        **fields,
    }
    return json.dumps(row, ensure_ascii=False) + "\n"


def test_the_release_split_keys_load(tmp_path):
    path = tmp_path / "split.jsonl"
    path.write_text(release_split_line(id="jhxaApn", uuid="0f8e6c1a-2b1c-4c59-9a8e-3c1d7a9b5e21"))
    (conversation,) = list(read_conversations(path))
    assert conversation.id == "jhxaApn"
    assert conversation.extra["uuid"] == "0f8e6c1a-2b1c-4c59-9a8e-3c1d7a9b5e21"
    assert conversation.extra["lang"] == "en" and conversation.extra["status"] == "success"
    assert conversation.messages[1]["reasoning_content"] == "Two plus two is four."
    assert "reasoning_content" not in conversation.messages[3]  # null: no reasoning, not an error
    # Written back unchanged but for the null reasoning.
    assert json.loads(conversation.to_json_line())["uuid"] == conversation.extra["uuid"]

    # A split whose rows carry only a uuid and an assistant turn with null content (reasoning hit the token
    # limit): the user-data path names the row by its uuid and reads the content as empty.
    row = json.loads(release_split_line(uuid="u-1"))
    row["conversations"][3]["content"] = None
    converted = from_user_row(row, "split.jsonl:1", "row-0")
    assert converted.id == "u-1" and converted.messages[3]["content"] == ""
    assert converted.messages[1]["reasoning_content"] == "Two plus two is four."


@pytest.mark.parametrize(
    "case,release_name,osprey_name",
    [
        ("osprey-2-qwen3", "Qwen3ForCausalLMEagle3", "OspreyQwen3ForCausalLMEagle3"),
        ("osprey-1-llama", "LlamaForCausalLMEagle3", "OspreyLlamaForCausalLMEagle3"),
    ],
)
def test_exports_can_carry_the_release_architecture_names(case, release_name, osprey_name, tmp_path):
    from megatron_osprey.export.formats import export_drafter, read_export
    from tests.unit.test_export import CASES, make_drafter

    drafter = make_drafter(*CASES[case])
    export_drafter(drafter, "sglang", tmp_path / "osprey")
    export_drafter(drafter, "sglang", tmp_path / "release", architecture_names="release")
    osprey, release = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("osprey", "release"))
    assert osprey["architectures"] == [osprey_name] and release["architectures"] == [release_name]
    # The release's patched SGLang keys its Osprey path on these; everything but the name is the same export.
    assert release["swap_h_and_emb"] is True and release["num_hidden_layers"] == drafter.config.num_layers
    assert {k: v for k, v in release.items() if k != "architectures"} == {
        k: v for k, v in osprey.items() if k != "architectures"
    }
    back = read_export(tmp_path / "release")
    assert back.config == drafter.config
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_architecture_names_are_checked(tmp_path):
    from megatron_osprey.export.formats import export_drafter
    from tests.unit.test_export import CASES, make_drafter

    drafter = make_drafter(*CASES["osprey-1-llama"])
    with pytest.raises(ValueError, match="--architecture-names must be one of"):
        export_drafter(drafter, "sglang", tmp_path / "a", architecture_names="vllm")
    with pytest.raises(ValueError, match="use --format sglang"):
        export_drafter(drafter, "hf", tmp_path / "b", architecture_names="release")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
