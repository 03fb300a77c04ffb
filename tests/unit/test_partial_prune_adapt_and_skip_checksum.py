"""prune and adapt mark their output partial until provenance.json (a run killed after its first file leaves an
output the next stage refuses and `--overwrite` cleans), and evaluate, export and rollout refuse a Megatron
checkpoint without checksums.json unless --skip-checksum, as pretrain and distill do."""

import json
import shutil

import pytest

from megatron_osprey.base.provenance import PROVENANCE_FILE, WRITING_MARKER, ProvenanceError
from megatron_osprey.stages import adapt, evaluate, export, prune, rollout
from megatron_osprey.stages.adapt import AdaptConfig
from megatron_osprey.stages.cli import check_inputs
from megatron_osprey.stages.prune import PruneConfig
from megatron_osprey.testing.distill_setup import write_chat_model, write_topic_conversations
from megatron_osprey.training.checkpoint_files import CHECKSUMS_FILE


class Killed(RuntimeError):
    """Stands for the signal that stops a run between two files."""


def _kill_after_first_file(*args, **kwargs):
    raise Killed("killed after the first file")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny chat target, a tiny small LM pruned to 2 layers, its adapted drafter, and 2 conversations."""
    root = tmp_path_factory.mktemp("partial")
    target = write_chat_model(root / "target", "qwen3", layers=8, hidden=64, seed=1)
    small_lm = write_chat_model(root / "small_lm", "llama3", layers=4, hidden=64, seed=2, qwen3=True)
    prune.run(PruneConfig(source=str(small_lm), output=str(root / "backbone"), num_layers=2, transformer_impl="local"))
    adapt.run(AdaptConfig(backbone=str(root / "backbone"), target=str(target), output=str(root / "drafter")))
    data = write_topic_conversations(root / "prompts.jsonl", 2)
    return {"root": root, "target": target, "small_lm": small_lm, "drafter": root / "drafter", "data": data}


def test_a_prune_killed_after_its_first_file_is_refused_downstream_and_cleaned_by_overwrite(models, tmp_path):
    import megatron_osprey.convert.megatron_to_hf as megatron_to_hf

    out = tmp_path / "pruned"
    config = PruneConfig(source=str(models["small_lm"]), output=str(out), num_layers=2, transformer_impl="local")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(megatron_to_hf, "export_to_hf", _kill_after_first_file)  # OUT/megatron is written first
        with pytest.raises(Killed):
            prune.run(config)
    assert (out / "megatron").is_dir() and not (out / "hf").exists() and not (out / PROVENANCE_FILE).exists()
    assert json.loads((out / WRITING_MARKER).read_text())["stage"] == "prune"
    # Before: the folder looked like a finished prune without its hf/ (adapt failed later, or read what was there).
    with pytest.raises(ValueError, match=rf"^--backbone {out} is a partial prune output: .* again with --overwrite"):
        adapt.run(AdaptConfig(backbone=str(out), target=str(models["target"]), output=str(tmp_path / "drafter")))
    assert not (tmp_path / "drafter").exists()
    # pretrain's --backbone reads OUT/megatron: refused by the provenance check of every input.
    with pytest.raises(ProvenanceError, match="a partial prune output"):
        check_inputs({"backbone": out / "megatron"})
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        prune.run(config)
    prune.run(PruneConfig(**{**config.__dict__, "overwrite": True}))
    assert not (out / WRITING_MARKER).exists() and json.loads((out / PROVENANCE_FILE).read_text())["stage"] == "prune"
    assert (out / "hf" / "config.json").is_file()


def test_an_adapt_killed_after_its_first_file_is_refused_downstream_and_cleaned_by_overwrite(models, tmp_path, capsys):
    import megatron_osprey.base.hf_files as hf_files

    out = tmp_path / "drafter"
    config = AdaptConfig(backbone=str(models["root"] / "backbone"), target=str(models["target"]), output=str(out))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf_files, "copy_tokenizer_files", _kill_after_first_file)  # after OUT/hf's weights
        with pytest.raises(Killed):
            adapt.run(config)
    assert any((out / "hf").glob("*.safetensors")) and not (out / "megatron").exists()
    assert json.loads((out / WRITING_MARKER).read_text())["stage"] == "adapt"
    # distill --drafter-init reads OUT/megatron and OUT/run_config.yaml; export and evaluate load OUT.
    with pytest.raises(ProvenanceError, match=rf"lies in {out}, a partial adapt output"):
        check_inputs({"drafter_init": out / "megatron"})
    assert export.main(["--checkpoint", str(out), "--format", "hf", "--output", str(tmp_path / "e")]) == 2
    assert f"--checkpoint {out} is a partial adapt output" in capsys.readouterr().err
    # Another stage's --overwrite does not take it: only adapt's.
    refused = PruneConfig(source=str(models["small_lm"]), output=str(out), overwrite=True, transformer_impl="local")
    with pytest.raises(ValueError, match="holds the output of the adapt stage, not of prune"):
        prune.run(refused)
    adapt.run(AdaptConfig(**{**config.__dict__, "overwrite": True}))
    assert not (out / WRITING_MARKER).exists() and (out / "megatron").is_dir()


@pytest.fixture(scope="module")
def unchecked_checkpoint(models, tmp_path_factory):
    """The adapted drafter's Megatron checkpoint, copied without its checksums.json."""
    copy = tmp_path_factory.mktemp("unchecked") / "megatron"
    shutil.copytree(models["drafter"] / "megatron", copy)
    (missing,) = copy.glob(f"iter_*/{CHECKSUMS_FILE}")
    missing.unlink()
    return copy, missing


@pytest.mark.parametrize("stage", ["export", "evaluate", "rollout"])
def test_a_checkpoint_without_checksums_is_refused_unless_skip_checksum(
    models, unchecked_checkpoint, tmp_path, capsys, stage
):
    checkpoint, missing = unchecked_checkpoint
    target, data, out = str(models["target"]), str(models["data"]), str(tmp_path / "out")
    argv = {
        "export": (export.main, ["--checkpoint", str(checkpoint), "--format", "hf", "--output", out]),
        "evaluate": (
            evaluate.main,
            ["--target", target, "--drafter", f"d={checkpoint}", "--data", data, "--output", out, "--limit", "1"]
            + ["--max-new-tokens", "4", "--no-progress"],
        ),
        "rollout": (
            rollout.main,
            ["--target", target, "--drafter", str(checkpoint), "--data", data, "--output", out, "--limit", "1"]
            + ["--max-new-tokens", "4"],
        ),
    }
    main, args = argv[stage]
    # Before: pretrain and distill had --skip-checksum; these three refused with no way to load a trusted copy.
    assert main(args) == 2
    refusal = capsys.readouterr().err
    assert main(args + ["--skip-checksum"]) == 0
    note = capsys.readouterr().err
    assert f"error: {missing} is missing: every save records it" in refusal
    assert "pass --skip-checksum to load them unverified (only a copy you trust)" in refusal
    assert f"--skip-checksum: the files of {checkpoint} were loaded without verification" in note
    assert (tmp_path / "out" / PROVENANCE_FILE).is_file()
