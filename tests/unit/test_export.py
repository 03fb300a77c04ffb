"""Export: sglang / hf / speculators round trips, SGLang's layer semantics on the exported names,
the plugin's weight mapping, refusals, and Megatron drafter -> SGLang export -> reference logits."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from megatron_osprey.export import layouts
from megatron_osprey.export.formats import export_drafter, read_export
from megatron_osprey.export.sglang_plugin.weight_names import layer_kinds, plugin_param_name
from megatron_osprey.models.drafter.reference import DrafterConfig, ReferenceDrafter, apply_rope
from megatron_osprey.stages.export import main as export_main
from tests.plugin_state import fused_state

VOCAB, DRAFT_VOCAB = 120, 90


def make_drafter(variant: str, layers: int, qk: bool, extra: str = "plain", seed: int = 0) -> ReferenceDrafter:
    torch.manual_seed(seed)
    drafter = ReferenceDrafter(
        DrafterConfig(
            hidden_size=32,
            target_hidden_size=24,
            num_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=48,
            vocab_size=VOCAB,
            draft_vocab_size=DRAFT_VOCAB,
            qk_layernorm=qk,
            aux_layer_ids=[1, 3, 5],
            variant=variant,
            eagle3_extra_layers=extra,
        )
    )
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.3)
    drafter.set_draft_vocab(torch.randperm(VOCAB)[:DRAFT_VOCAB])
    return drafter.eval()


CASES = {
    "osprey-2-qwen3": ("osprey", 2, True, "plain"),
    "osprey-1-llama": ("osprey", 1, False, "plain"),
    "eagle3-1-llama": ("eagle3", 1, False, "plain"),
    "eagle3-2-plain": ("eagle3", 2, False, "plain"),
    "eagle3-3-fused": ("eagle3", 3, True, "fused"),
}


def _same_state(a: ReferenceDrafter, b: ReferenceDrafter) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("case", list(CASES))
def test_sglang_and_hf_exports_read_back_bit_identical(case, tmp_path):
    drafter = make_drafter(*CASES[case])
    export_drafter(drafter, "sglang", tmp_path / "sglang")
    back = read_export(tmp_path / "sglang")
    _same_state(drafter, back)
    assert back.config == drafter.config
    export_drafter(drafter, "hf", tmp_path / "hf")
    _same_state(drafter, ReferenceDrafter.from_pretrained(tmp_path / "hf"))


def test_sglang_config_and_names_follow_the_serving_layout(tmp_path):
    export_drafter(make_drafter("osprey", 2, True).to(torch.bfloat16), "sglang", tmp_path / "o")
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert config["architectures"] == ["OspreyQwen3ForCausalLMEagle3"] and config["swap_h_and_emb"] is True
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert (config["draft_vocab_size"], config["vocab_size"], config["target_hidden_size"]) == (DRAFT_VOCAB, VOCAB, 24)
    assert config["num_hidden_layers"] == 2 and config["torch_dtype"] == "bfloat16"
    names = load_file(str(tmp_path / "o" / "model.safetensors"))
    assert {
        "embed_tokens.weight",
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        "layers.1.hidden_norm.weight",
        "layers.1.self_attn.q_norm.weight",
    } <= set(names)
    assert names["t2d"].shape == (VOCAB,) and names["t2d"].dtype == torch.bool and names["d2t"].dtype == torch.int64

    export_drafter(make_drafter("eagle3", 1, False), "sglang", tmp_path / "e")
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and "swap_h_and_emb" not in config
    assert all(not k.startswith("layers.") for k in load_file(str(tmp_path / "e" / "model.safetensors")))
    assert "midlayer.hidden_norm.weight" in load_file(str(tmp_path / "e" / "model.safetensors"))


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _sglang_forward(t: dict, config: dict, ids: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """SGLang's EAGLE-3 draft computation written against the exported names, independent of the reference
    module: a fused layer attends over cat(input_layernorm(a), hidden_norm(b)) with residual b; swap mode
    passes (a, b) = (fc(aux), embedding), otherwise (embedding, fc(aux)); plain layers are Llama layers."""
    eps, h, heads, kv, hd = (
        config[k] for k in ("rms_norm_eps", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    )
    n = config["num_hidden_layers"]
    emb, g = t["embed_tokens.weight"][ids], aux @ t["fc.weight"].T
    side, stream = (g, emb) if config.get("swap_h_and_emb") else (emb, g)
    positions = torch.arange(ids.shape[0])[None]
    inv_freq = 1.0 / (config["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    causal = torch.ones(ids.shape[0], ids.shape[0], dtype=torch.bool).tril()
    for i, kind in enumerate(layer_kinds(config)):
        p = "midlayer" if n == 1 else f"layers.{i}"
        if kind == "fused":
            attn_in = torch.cat(
                [_rms(side, t[f"{p}.input_layernorm.weight"], eps), _rms(stream, t[f"{p}.hidden_norm.weight"], eps)], -1
            )
        else:
            attn_in = _rms(stream, t[f"{p}.input_layernorm.weight"], eps)
        q = (attn_in @ t[f"{p}.self_attn.q_proj.weight"].T).view(-1, heads, hd)
        k = (attn_in @ t[f"{p}.self_attn.k_proj.weight"].T).view(-1, kv, hd)
        v = (attn_in @ t[f"{p}.self_attn.v_proj.weight"].T).view(-1, kv, hd)
        if f"{p}.self_attn.q_norm.weight" in t:
            q, k = _rms(q, t[f"{p}.self_attn.q_norm.weight"], eps), _rms(k, t[f"{p}.self_attn.k_norm.weight"], eps)
        q = apply_rope(q.transpose(0, 1)[None], positions, inv_freq)[0]
        k = apply_rope(k.transpose(0, 1)[None], positions, inv_freq)[0].repeat_interleave(heads // kv, 0)
        v = v.transpose(0, 1).repeat_interleave(heads // kv, 0)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~causal, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(-1, heads * hd) @ t[f"{p}.self_attn.o_proj.weight"].T
        stream = stream + out
        x = _rms(stream, t[f"{p}.post_attention_layernorm.weight"], eps)
        mlp = F.silu(x @ t[f"{p}.mlp.gate_proj.weight"].T) * (x @ t[f"{p}.mlp.up_proj.weight"].T)
        stream = stream + mlp @ t[f"{p}.mlp.down_proj.weight"].T
    return _rms(stream, t["norm.weight"], eps) @ t["lm_head.weight"].T


@pytest.mark.parametrize("case", ["osprey-2-qwen3", "osprey-1-llama", "eagle3-1-llama", "eagle3-2-plain"])
def test_sglang_semantics_on_exported_names_give_the_reference_logits(case, tmp_path):
    drafter = make_drafter(*CASES[case]).double()
    export_drafter(drafter, "sglang", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    ids, aux = torch.randint(0, VOCAB, (7,)), torch.randn(7, 3 * 24, dtype=torch.float64)
    expected, _ = drafter(ids[None], aux_hidden=aux[None])
    # The reference norms and rotary angles run in float32, hence 1e-5 (a wrong name swap is off by O(1)).
    torch.testing.assert_close(_sglang_forward(tensors, config, ids, aux), expected[0], atol=1e-5, rtol=0)


def test_plugin_weight_names_cover_every_exported_tensor(tmp_path):
    drafter = make_drafter("osprey", 2, True)
    export_drafter(drafter, "sglang", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert plugin_param_name("midlayer.self_attn.k_proj.weight") == ("model.layers.0.self_attn.qkv_proj.weight", "k")
    assert plugin_param_name("layers.1.mlp.up_proj.weight") == ("model.layers.1.mlp.gate_up_proj.weight", 1)
    assert plugin_param_name("d2t") is None and plugin_param_name("lm_head.weight") == ("lm_head.weight", None)
    fused = fused_state(tensors)
    ref = drafter.state_dict()
    qkv = fused["model.layers.1.self_attn.qkv_proj.weight"]
    assert qkv.shape == (32 + 16 + 16, 64)
    assert torch.equal(qkv, torch.cat([ref[f"layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]))
    # Osprey swap: the plugin's input_layernorm is the reference hidden_norm (the norm on g).
    assert torch.equal(fused["model.layers.0.input_layernorm.weight"], ref["layers.0.hidden_norm.weight"])
    assert (
        len(fused) == len([k for k in tensors if k not in ("d2t", "t2d")]) - 2 * 3
    )  # per layer q,k,v -> 1 and gate,up -> 1
    assert layer_kinds({"num_hidden_layers": 3, "eagle3_extra_layers": "plain"}) == ["fused", "plain", "plain"]
    assert layer_kinds({"num_hidden_layers": 2, "swap_h_and_emb": True}) == ["fused", "fused"]
    # A multi-layer EAGLE-3 config that does not say is refused, never assumed fused.
    with pytest.raises(ValueError, match="eagle3_extra_layers"):
        layer_kinds({"num_hidden_layers": 2})


def test_speculators_round_trip_and_refusals(tmp_path):
    drafter = make_drafter("eagle3", 1, False)
    export_drafter(drafter, "speculators", tmp_path / "s")
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert config["architectures"] == ["Eagle3Speculator"] and config["speculators_model_type"] == "eagle3"
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1 and config["norm_before_residual"] is False
    assert "layers.0.hidden_norm.weight" in load_file(str(tmp_path / "s" / "model.safetensors"))
    # vLLM counts a tap as the hidden state after L layers: layer id i is written as i + 1.
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in drafter.config.aux_layer_ids]
    _same_state(drafter, read_export(tmp_path / "s"))
    third_party = {k: v for k, v in config.items() if k != "megatron_osprey"}
    assert layouts.drafter_config_from_export(third_party).aux_layer_ids == list(drafter.config.aux_layer_ids)
    for case in ("osprey-2-qwen3", "eagle3-2-plain"):
        with pytest.raises(ValueError, match="--format speculators"):
            export_drafter(make_drafter(*CASES[case]), "speculators", tmp_path / case)
        assert not (tmp_path / case).exists()


def test_tool_refuses_a_non_empty_output_and_overwrites_only_its_own(tmp_path, capsys):
    make_drafter("osprey", 2, True).save_pretrained(tmp_path / "ckpt")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    args = ["--checkpoint", str(tmp_path / "ckpt"), "--format", "sglang", "--output"]
    assert export_main([*args, str(tmp_path / "out")]) == 2
    assert "--overwrite" in capsys.readouterr().err and (tmp_path / "out" / "keep.txt").exists()
    # --overwrite deletes only a directory this stage wrote: a folder holding someone's file is refused, kept whole.
    assert export_main([*args, str(tmp_path / "out"), "--overwrite"]) == 2
    assert "did not write it" in capsys.readouterr().err and (tmp_path / "out" / "keep.txt").exists()
    # Its own earlier export is replaced.
    assert export_main([*args, str(tmp_path / "mine")]) == 0
    (tmp_path / "mine" / "stale.txt").write_text("old")
    assert export_main([*args, str(tmp_path / "mine"), "--overwrite"]) == 0
    assert not (tmp_path / "mine" / "stale.txt").exists() and (tmp_path / "mine" / "config.json").is_file()
    # An output holding its own input is refused before anything is read or deleted.
    assert export_main(["--checkpoint", str(tmp_path / "ckpt"), "--format", "sglang", "--output", str(tmp_path),
                        "--overwrite"]) == 2  # fmt: skip
    assert (tmp_path / "ckpt" / "config.json").is_file()
    assert (
        export_main(
            ["--checkpoint", str(tmp_path / "ckpt"), "--format", "speculators", "--output", str(tmp_path / "spec")]
        )
        == 2
    )
    assert "Osprey" in capsys.readouterr().err


def test_plugin_package_imports_without_sglang():
    import importlib.util

    import megatron_osprey.export.sglang_plugin  # noqa: F401  (pure: SGLang imports only in eagle3_models)

    if importlib.util.find_spec("sglang") is None:
        with pytest.raises(ModuleNotFoundError, match="sglang"):
            import megatron_osprey.export.sglang_plugin.eagle3_models  # noqa: F401


def test_megatron_checkpoint_exported_to_sglang_gives_the_megatron_logits(adapted_drafter, tmp_path):
    from megatron_osprey.base.run_config import load_run_config
    from megatron_osprey.models.drafter.model import DrafterArch, build_drafter_model
    from megatron_osprey.parallel import ParallelConfig, parallel_context
    from megatron_osprey.training.checkpointing import load_checkpoint

    ckpt = adapted_drafter["drafter"] / "megatron"
    assert export_main(["--checkpoint", str(ckpt), "--format", "sglang", "--output", str(tmp_path / "sg")]) == 0
    config = json.loads((tmp_path / "sg" / "config.json").read_text())
    assert config["architectures"] == ["OspreyQwen3ForCausalLMEagle3"] and config["num_hidden_layers"] == 2
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # 8-layer target
    assert (tmp_path / "sg" / "tokenizer.json").is_file()  # the target's tokenizer travels along
    reference = read_export(tmp_path / "sg")

    torch.manual_seed(0)
    arch = DrafterArch.from_dict(load_run_config(adapted_drafter["drafter"])["drafter"])
    ids = torch.randint(0, 128256, (1, 9))
    aux = torch.randn(1, 9, 3 * 96)
    with torch.no_grad():
        # Train W_new away from zero so the side path (and the swapped norm names) matter.
        for layer in reference.layers:
            layer.self_attn.q_proj.weight[:, :64].normal_(0, 0.2)
            layer.self_attn.k_proj.weight[:, :64].normal_(0, 0.2)
            layer.hidden_norm.weight.mul_(1.5)
        export_drafter(reference, "hf", tmp_path / "trained")
        with parallel_context(ParallelConfig()) as state:
            from megatron_osprey.models.drafter.convert import load_reference_state

            model = build_drafter_model(arch, state.config).eval()
            loaded, _ = load_checkpoint(ckpt, model.sharded_state_dict())
            model.load_state_dict(loaded)
            load_reference_state(model, ReferenceDrafter.from_pretrained(tmp_path / "trained").state_dict(), 0, 1)
            megatron_logits, _ = model(ids, aux_hidden=aux)
        export_drafter(ReferenceDrafter.from_pretrained(tmp_path / "trained"), "sglang", tmp_path / "sg2")
        got, _ = read_export(tmp_path / "sg2")(ids, aux_hidden=aux)
    torch.testing.assert_close(got, megatron_logits[..., : arch.draft_vocab_size], atol=1e-5, rtol=0)


def test_checkpoint_errors_name_the_checkpoint_flag_and_help_says_what_to_trust(tmp_path, capsys):
    assert (
        export_main(
            ["--checkpoint", str(tmp_path / "missing"), "--format", "sglang", "--output", str(tmp_path / "out")]
        )
        == 2
    )
    assert f"--checkpoint {tmp_path / 'missing'}: no such directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert (
        export_main(["--checkpoint", str(tmp_path / "empty"), "--format", "sglang", "--output", str(tmp_path / "out")])
        == 2
    )
    err = capsys.readouterr().err
    assert f"--checkpoint {tmp_path / 'empty'} is not a drafter directory" in err and "--drafter" not in err
    with pytest.raises(SystemExit):
        export_main(["--help"])
    assert "load only checkpoints you trust" in " ".join(capsys.readouterr().out.split())


# A stage killed after writing its files, before its record: what kill -9 or a lost node leaves.
KILLED_BEFORE_RECORD = """
import os, sys
from megatron_osprey.stages import cli
cli.Invocation.record = lambda *args, **kwargs: os._exit(9)
from megatron_osprey.stages.{stage} import main
sys.exit(main(sys.argv[1:]))
"""


def run_killed_before_record(stage: str, argv: list[str]) -> int:
    import os
    import subprocess
    import sys

    script = KILLED_BEFORE_RECORD.replace("{stage}", stage)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", script, *argv], env=env, timeout=300).returncode


def test_an_export_killed_midway_is_refused_by_evaluate_and_cleaned_by_overwrite(tmp_path, capsys):
    from megatron_osprey.eval.loading import load_drafter

    make_drafter("osprey", 2, True).save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "out"
    args = ["--checkpoint", str(tmp_path / "ckpt"), "--format", "sglang", "--output", str(out)]
    assert run_killed_before_record("export", args) == 9
    assert (out / "model.safetensors").is_file() and not (out / "provenance.json").exists()
    with pytest.raises(ValueError, match=rf"^--drafter {out} is a partial export output: that stage stopped"):
        load_drafter(out)
    assert export_main(args) == 2 and "pass --overwrite" in capsys.readouterr().err
    assert export_main([*args, "--overwrite"]) == 0  # its own partial output
    assert isinstance(load_drafter(out).drafter, ReferenceDrafter)


@pytest.mark.parametrize("fmt", ["sglang", "hf"])
def test_a_truncated_export_weights_file_is_one_line_naming_it(tmp_path, fmt, capsys):
    # The case: safetensors' SafetensorError (a traceback) from evaluate or a second export reading it.
    from megatron_osprey.eval.loading import load_drafter

    export_drafter(make_drafter("osprey", 2, True), fmt, tmp_path / "x")
    weights = tmp_path / "x" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"^{weights} is not a readable safetensors file \(.*\); it is truncated"):
        load_drafter(tmp_path / "x")
    args = ["--checkpoint", str(tmp_path / "x"), "--format", "sglang", "--output", str(tmp_path / "again")]
    assert export_main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {weights} is not a readable safetensors file") and err.count("\n") == 1
