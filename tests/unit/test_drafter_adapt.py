"""Stage 3: vocabulary alignment, function preservation at init, gradients, Megatron == reference."""

import json

import pytest
import torch

from megatron_osprey.base.run_config import load_run_config
from megatron_osprey.models.drafter.adapt import adapt_reference_drafter
from megatron_osprey.models.drafter.model import DrafterArch, build_drafter_model
from megatron_osprey.models.drafter.reference import ReferenceDrafter
from megatron_osprey.models.drafter.vocab_alignment import align_vocabularies, view_of
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.stages import adapt
from megatron_osprey.stages.adapt import AdaptConfig
from megatron_osprey.training.checkpointing import load_checkpoint


@pytest.fixture(scope="module")
def alignment(real_tokenizers):
    return align_vocabularies(
        view_of(real_tokenizers["qwen3"]), view_of(real_tokenizers["llama3"]), 128256, policy="bytes_and_roles"
    )


def test_qwen3_to_llama3_counts_match_the_paper(adapted_drafter):
    # The default (reference) rule reproduces the paper and the released aligner exactly.
    counts = adapted_drafter["report"]["counts"]
    assert adapted_drafter["report"]["policy"] == "reference"
    assert counts == {"copied": 109_566, "single": 297, "averaged": 18_393, "unmapped": 0, "unused": 0}
    assert adapted_drafter["report"]["partial_utf8_tokens"] == 375  # 297 of them land on one U+FFFD token
    on_disk = json.loads((adapted_drafter["drafter"] / "tokenizer_alignment.json").read_text())
    assert on_disk["counts"] == counts and on_disk["rules"]["single"].startswith("the decoded string")
    assert on_disk["special_tokens"]["<|eot_id|>"].startswith("averaged: ['<', '|'")  # the literal string


def test_reference_rule_on_known_tokens(real_tokenizers):
    qwen, llama = real_tokenizers["qwen3"], real_tokenizers["llama3"]
    reference = align_vocabularies(view_of(qwen), view_of(llama), 128300)  # 44 padding rows
    partial = llama.convert_tokens_to_ids("¬¬")  # bytes AC AC: two UTF-8 continuation bytes, no lead byte
    assert llama.convert_tokens_to_string(["¬¬"]) == "\ufffd\ufffd"
    assert reference.kinds[partial] == "single" and reference.sources[partial] == [qwen.convert_tokens_to_ids("ï¿½ï¿½")]
    eot = llama.convert_tokens_to_ids("<|eot_id|>")
    assert reference.kinds[eot] == "averaged" and reference.sources[eot] == qwen.encode("<|eot_id|>")
    assert reference.kinds[-44:] == ["unused"] * 44 and reference.sources[-1] == []
    matrix = torch.randn(len(qwen), 8)
    from megatron_osprey.models.drafter.vocab_alignment import aligned_rows

    rows = aligned_rows(matrix, reference)
    assert torch.equal(rows[-1], torch.zeros(8))  # the reference zeroes rows beyond the tokenizer
    torch.testing.assert_close(rows[eot], matrix[qwen.encode("<|eot_id|>")].mean(0))
    assert torch.equal(rows[partial], matrix[reference.sources[partial][0]])


def test_bytes_and_roles_policy_on_known_tokens(real_tokenizers, alignment):
    qwen, llama = real_tokenizers["qwen3"], real_tokenizers["llama3"]
    assert alignment.counts() == {"copied": 109_566, "averaged": 18_434, "special": 1, "fallback": 255, "unused": 0}
    the = llama.convert_tokens_to_ids("Ġthe")
    assert alignment.kinds[the] == "copied" and alignment.sources[the] == [qwen.convert_tokens_to_ids("Ġthe")]
    double_zero = llama.convert_tokens_to_ids("00")  # Qwen splits digits
    assert alignment.kinds[double_zero] == "averaged"
    assert alignment.sources[double_zero] == [qwen.convert_tokens_to_ids("0")] * 2
    eot = llama.convert_tokens_to_ids("<|eot_id|>")
    assert alignment.kinds[eot] == "special" and alignment.sources[eot] == [qwen.convert_tokens_to_ids("<|im_end|>")]
    bos = llama.convert_tokens_to_ids("<|begin_of_text|>")  # Qwen3 has no BOS
    assert alignment.kinds[bos] == "fallback" and alignment.sources[bos] == []
    partial = llama.convert_tokens_to_ids("¬¬")  # averaged over its two byte tokens
    assert (
        alignment.kinds[partial] == "averaged" and alignment.sources[partial] == [qwen.convert_tokens_to_ids("¬")] * 2
    )


@pytest.mark.parametrize("policy", ["reference", "bytes_and_roles"])
def test_identical_tokenizers_copy_every_row(real_tokenizers, policy):
    view = view_of(real_tokenizers["qwen3"])
    same = align_vocabularies(view, view, 151936, policy=policy)
    real = len(real_tokenizers["qwen3"])
    assert all(same.sources[i] == [i] for i in range(real))
    counts = same.counts()
    assert sum(counts.get(kind, 0) for kind in ("single", "averaged", "fallback", "unmapped")) == 0
    assert counts["copied"] + counts.get("special", 0) == real
    assert same.counts()["unused"] == 151936 - real  # the config's padding rows


def _copied_ids(alignment, count, generator):
    copied = [t for t, kind in enumerate(alignment.kinds) if kind == "copied"]
    picks = torch.randint(0, len(copied), (count,), generator=generator)
    return torch.tensor([copied[i] for i in picks])


def test_function_preservation_in_reference_and_megatron(adapted_drafter, alignment):
    from transformers import AutoModelForCausalLM

    generator = torch.Generator().manual_seed(0)
    target_ids = _copied_ids(alignment, 24, generator)[None]
    backbone_ids = torch.tensor([[alignment.sources[t][0] for t in target_ids[0].tolist()]])
    backbone = AutoModelForCausalLM.from_pretrained(adapted_drafter["backbone"] / "hf").eval()
    reference = ReferenceDrafter.from_pretrained(adapted_drafter["drafter"] / "hf").eval()
    aux = torch.randn(1, 24, 3 * 96, generator=generator)  # random g: W_new = 0 must ignore it
    with torch.no_grad():
        expected = backbone(backbone_ids).logits[0]
        got, _ = reference(target_ids, aux_hidden=aux)
    got = got[0]
    copied = [t for t, k in enumerate(alignment.kinds) if k == "copied"]
    sources = torch.tensor([alignment.sources[t][0] for t in copied])
    torch.testing.assert_close(got[:, copied], expected[:, sources], atol=1e-5, rtol=0)
    averaged = [t for t, k in enumerate(alignment.kinds) if k == "averaged"][:500]
    for t in averaged:  # the averaging formula: mean of the source rows' logits
        torch.testing.assert_close(got[:, t], expected[:, alignment.sources[t]].mean(dim=1), atol=1e-5, rtol=0)

    run_config = load_run_config(adapted_drafter["drafter"])
    arch = DrafterArch.from_dict(run_config["drafter"])
    with parallel_context(ParallelConfig()) as state:
        model = build_drafter_model(arch, state.config).eval()
        loaded, _ = load_checkpoint(adapted_drafter["drafter"] / "megatron", model.sharded_state_dict())
        model.load_state_dict(loaded)
        with torch.no_grad():
            megatron_logits, _ = model(target_ids, aux_hidden=aux)
            ttt_megatron, _ = model.ttt_forward(target_ids, aux, 3)
            ttt_reference = reference.ttt_forward(target_ids, aux, 3)
    torch.testing.assert_close(megatron_logits[0, :, :128256], got, atol=1e-5, rtol=0)
    for mine, theirs in zip(ttt_megatron, ttt_reference):
        torch.testing.assert_close(mine[..., :128256], theirs, atol=1e-5, rtol=0)


def _w_new_and_fc_grads(drafter, ids, aux, labels):
    drafter.zero_grad()
    logits, _ = drafter(ids, aux_hidden=aux)
    torch.nn.functional.cross_entropy(logits[0], labels).backward()
    h = drafter.config.hidden_size
    w_new = drafter.layers[0].self_attn.q_proj.weight.grad[:, :h]
    return w_new.abs().sum().item(), drafter.fc.weight.grad.abs().sum().item()


def test_side_path_is_not_a_stationary_point(adapted_drafter):
    drafter = ReferenceDrafter.from_pretrained(adapted_drafter["drafter"] / "hf")
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128000, (1, 16), generator=generator)
    aux = torch.randn(1, 16, 3 * 96, generator=generator)
    labels = torch.randint(0, 128000, (16,), generator=generator)
    w_new, fc = _w_new_and_fc_grads(drafter, ids, aux, labels)
    assert w_new > 0  # identity fc: W_new gets a gradient on the first backward
    assert fc == 0  # fc is reached only through W_new, which is still zero
    with torch.no_grad():  # one step on W_new, then fc gets its gradient too
        for layer in drafter.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight[:, :64] -= 1e-2 * proj.weight.grad[:, :64].sign()
    assert _w_new_and_fc_grads(drafter, ids, aux, labels)[1] > 0
    stationary = ReferenceDrafter.from_pretrained(adapted_drafter["drafter"] / "hf")
    with torch.no_grad():
        stationary.fc.weight.zero_()
    assert _w_new_and_fc_grads(stationary, ids, aux, labels) == (0.0, 0.0)  # why fc is not zero-initialized


def test_fc_starts_as_identity_on_the_deepest_tap(adapted_drafter):
    fc = ReferenceDrafter.from_pretrained(adapted_drafter["drafter"] / "hf").fc.weight
    h, ht = 64, 96
    assert torch.equal(fc[:, 2 * ht : 2 * ht + h], torch.eye(h))
    assert fc[:, : 2 * ht].abs().sum() == 0 and fc[:, 2 * ht + h :].abs().sum() == 0


def test_reduced_draft_vocab(adapted_drafter, tmp_path):
    counts = [0] * 128256
    for rank, token_id in enumerate(range(1000, 1100)):
        counts[token_id] = 1000 - rank
    counts[5] = 5000
    (tmp_path / "counts.json").write_text(json.dumps(counts))
    out = tmp_path / "reduced"
    adapt.run(  # the stage: its own process groups, then OUT/hf, OUT/megatron and the report
        AdaptConfig(
            backbone=str(adapted_drafter["backbone"]),
            target=str(adapted_drafter["target"]),
            output=str(out),
            draft_vocab_size=64,
            token_counts=str(tmp_path / "counts.json"),
        )
    )
    reduced = ReferenceDrafter.from_pretrained(out / "hf")
    full = ReferenceDrafter.from_pretrained(adapted_drafter["drafter"] / "hf")
    expected_ids = torch.tensor([5] + list(range(1000, 1063)))
    assert reduced.d2t.dtype == torch.int64 and reduced.t2d.dtype == torch.bool
    assert torch.equal(torch.arange(64) + reduced.d2t, expected_ids)
    assert reduced.t2d.sum() == 64 and bool(reduced.t2d[expected_ids].all())
    assert torch.equal(reduced.lm_head.weight, full.lm_head.weight[expected_ids])


def _target_arch(target_dir):
    from megatron_osprey.base.arch import ModelArch

    return ModelArch.from_hf_config(target_dir)


@pytest.mark.parametrize("aux", [[1, 3, 8], [2, 2, 3]])
def test_bad_aux_layer_ids(adapted_drafter, tmp_path, aux):
    with pytest.raises(ValueError, match=r"--aux-layer-ids .* \(the target has 8 layers\)"):
        adapt_reference_drafter(
            AdaptConfig(
                backbone=adapted_drafter["backbone"],
                target=adapted_drafter["target"],
                output=tmp_path / "o",
                aux_layer_ids=aux,
            ),
            _target_arch(adapted_drafter["target"]),
        )


def test_target_without_vocabulary(adapted_drafter, tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    target = tmp_path / "empty_target"
    (target).mkdir()
    (target / "config.json").write_text((adapted_drafter["target"] / "config.json").read_text())
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE())).save_pretrained(target)
    with pytest.raises(ValueError, match="--target .* has no vocabulary"):
        adapt_reference_drafter(
            AdaptConfig(backbone=adapted_drafter["backbone"], target=target, output=tmp_path / "o"),
            _target_arch(target),
        )


def test_a_drafter_checkpoint_is_not_a_backbone(adapted_drafter, tmp_path):
    # (A plain HF model directory is a backbone: the released one; see the released-backbone test.)
    target = _target_arch(adapted_drafter["target"])
    with pytest.raises(ValueError, match="stage='adapt'"):
        adapt_reference_drafter(
            AdaptConfig(backbone=adapted_drafter["drafter"], target=adapted_drafter["target"], output=tmp_path / "o"),
            target,
        )


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_refused_first(adapted_drafter, tmp_path):
    # What a 3-process torchrun would pass: checked before any tokenizer, weight or collective.
    with pytest.raises(
        ValueError,
        match=r"--tensor-model-parallel-size 3 does not divide the model's "
        r"num_attention_heads \(4\)",
    ):
        adapt_reference_drafter(
            AdaptConfig(backbone=adapted_drafter["backbone"], target=adapted_drafter["target"], output=tmp_path / "o"),
            _target_arch(adapted_drafter["target"]),
            tensor_parallel_size=3,
        )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "content, why",
    [
        ("{not json", "cannot be read"),
        ("7", "holds a JSON int"),
        ('"counts"', "holds a JSON str"),
        (json.dumps([1] * 11), "holds 11 counts, more than the target's vocabulary of 10"),
        (json.dumps([3, -1, 2]), "the count of id 1 is -1, not an integer >= 0"),
        (json.dumps([3, 1.5]), "the count of id 1 is 1.5, not an integer >= 0"),
        (json.dumps([3, "many"]), "the count of id 1 is 'many', not an integer >= 0"),
        (json.dumps([3, None]), "the count of id 1 is None, not an integer >= 0"),
        (json.dumps([True, 2]), "the count of id 0 is True, not an integer >= 0"),
        (json.dumps({"2": 5, "the": 3}), "its keys must be token ids"),
        (json.dumps({"2": 5, "10": 3}), r"id 10 is outside the target vocabulary \(0\.\.9\)"),
        (json.dumps([0, 0, 0]), "every count is 0"),
    ],
)
def test_bad_token_counts_name_the_file(tmp_path, content, why):
    from megatron_osprey.models.drafter.adapt import load_token_counts

    path = tmp_path / "token_counts.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"^--token-counts {path}: {why}"):
        load_token_counts(path, 10)


def test_token_counts_as_a_list_up_to_the_vocabulary_or_an_object(tmp_path):
    from megatron_osprey.models.drafter.adapt import load_token_counts

    # A list as long as the tokenizer: a padded vocabulary's extra ids count 0.
    (tmp_path / "list.json").write_text(json.dumps([4, 0, 7]))
    assert load_token_counts(tmp_path / "list.json", 5).tolist() == [4, 0, 7, 0, 0]
    (tmp_path / "object.json").write_text(json.dumps({"4": 2, "1": 9}))
    assert load_token_counts(tmp_path / "object.json", 5).tolist() == [0, 9, 0, 0, 2]
