"""Reference drafter: function preservation, gradient path, TTT unroll, save/load."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from megatron_osprey.models.drafter.reference import DrafterConfig, DrafterKVCache, ReferenceDrafter

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def tiny_backbone(family: str, layers: int = 3, seed: int = 0):
    """A random HF backbone (Qwen3 with q/k norms, or Llama with llama3 rope scaling)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(rope_theta=10000.0, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(rope_theta=10000.0, rope_scaling=dict(LLAMA3_ROPE), **common))
    with torch.no_grad():  # HF inits norms to ones; randomize so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model.eval()


def drafter_from_backbone(hf, num_layers: int, target_hidden: int = 40) -> ReferenceDrafter:
    """Osprey drafter with the first num_layers blocks of hf in the pretrained half, W_new = 0."""
    c = hf.config
    cfg = DrafterConfig(
        hidden_size=c.hidden_size,
        target_hidden_size=target_hidden,
        num_layers=num_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        intermediate_size=c.intermediate_size,
        vocab_size=c.vocab_size,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_parameters["rope_theta"],
        rope_scaling=LLAMA3_ROPE if c.rope_parameters["rope_type"] == "llama3" else None,
        qk_layernorm=isinstance(hf, Qwen3ForCausalLM),
        aux_layer_ids=[1, 2, 3],
    )
    drafter = ReferenceDrafter(cfg)
    sd = hf.state_dict()
    h = c.hidden_size
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(sd["model.embed_tokens.weight"])
        drafter.norm.weight.copy_(sd["model.norm.weight"])
        drafter.lm_head.weight.copy_(sd["lm_head.weight"])
        for i, layer in enumerate(drafter.layers):
            src = f"model.layers.{i}."
            for name in ("q_proj", "k_proj", "v_proj"):
                proj = getattr(layer.self_attn, name)
                proj.weight.normal_()  # garbage in W_new; init_osprey_side_path must zero it
                proj.weight[:, h:] = sd[src + f"self_attn.{name}.weight"]
            layer.self_attn.o_proj.weight.copy_(sd[src + "self_attn.o_proj.weight"])
            if cfg.qk_layernorm:
                layer.self_attn.q_norm.weight.copy_(sd[src + "self_attn.q_norm.weight"])
                layer.self_attn.k_norm.weight.copy_(sd[src + "self_attn.k_norm.weight"])
            layer.input_layernorm.weight.copy_(sd[src + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(sd[src + "post_attention_layernorm.weight"])
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, name).weight.copy_(sd[src + f"mlp.{name}.weight"])
    drafter.init_osprey_side_path()
    return drafter


def truncated_hf(hf, num_layers: int):
    """The HF model keeping its first num_layers blocks (final norm and head as is)."""
    hf.model.layers = hf.model.layers[:num_layers]
    hf.config.num_hidden_layers = num_layers
    return hf


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_osprey_init_preserves_backbone_function_for_any_g(family):
    hf = tiny_backbone(family, layers=3)
    drafter = drafter_from_backbone(hf, num_layers=2).eval()
    reference = truncated_hf(hf, 2)
    ids = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        expected = reference(ids).logits
        for scale in (1.0, 50.0):
            aux = scale * torch.randn(2, 11, 3 * drafter.config.target_hidden_size)
            logits, _ = drafter(ids, aux_hidden=aux)
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        # Non-zero W_new must break the equality (so the test above is not vacuous).
        drafter.layers[0].self_attn.q_proj.weight[:, :32].normal_()
        logits, _ = drafter(ids, aux_hidden=aux)
    assert (logits - expected).abs().max() > 1e-2


def test_identity_fc_opens_the_gradient_path_that_zero_fc_closes():
    drafter = drafter_from_backbone(tiny_backbone("qwen3"), num_layers=2)
    ht = drafter.config.target_hidden_size
    fc = drafter.fc.weight
    assert torch.equal(fc[:32, 2 * ht : 2 * ht + 32], torch.eye(32)) and fc[:, : 2 * ht].abs().sum() == 0
    ids, aux = torch.randint(0, 96, (2, 9)), torch.randn(2, 9, 3 * ht)
    labels = torch.randint(0, 96, (18,))

    def backward():
        drafter.zero_grad()
        logits, _ = drafter(ids, aux_hidden=aux)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels).backward()

    def w_new_grad():
        return sum(layer.self_attn.q_proj.weight.grad[:, :32].abs().sum() for layer in drafter.layers)

    backward()
    assert w_new_grad() > 0 and all(
        layer.self_attn.v_proj.weight.grad[:, :32].abs().sum() > 0 for layer in drafter.layers
    )
    # fc sits behind W_new = 0, so its first gradient is exactly zero; one step on W_new opens it.
    assert drafter.fc.weight.grad.abs().sum() == 0
    with torch.no_grad():
        for layer in drafter.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight[:, :32] -= 0.5 * proj.weight.grad[:, :32]
    backward()
    assert drafter.fc.weight.grad.abs().sum() > 0
    # The stationary point DESIGN warns about: zero fc and zero W_new give neither a gradient.
    drafter.init_osprey_side_path()
    with torch.no_grad():
        drafter.fc.weight.zero_()
    backward()
    assert w_new_grad() == 0 and drafter.fc.weight.grad.abs().sum() == 0


def tiny_drafter(variant: str, layers: int = 2, draft_vocab: int = 60, extra: str = "plain", seed: int = 1):
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        hidden_size=32,
        target_hidden_size=24,
        num_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=96,
        draft_vocab_size=draft_vocab,
        qk_layernorm=True,
        aux_layer_ids=[1, 2, 3],
        variant=variant,
        eagle3_extra_layers=extra,
    )
    drafter = ReferenceDrafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.3)
    drafter.set_draft_vocab(torch.randperm(96)[:draft_vocab])
    return drafter.eval()


@pytest.mark.parametrize("variant,extra", [("osprey", "plain"), ("eagle3", "plain"), ("eagle3", "fused")])
def test_ttt_step0_equals_forward_and_later_steps_match_incremental_decoding(variant, extra):
    drafter = tiny_drafter(variant, extra=extra)
    b, t, steps = 2, 8, 3
    ids = torch.randint(0, 96, (b, t))
    aux = torch.randn(b, t, 72)
    with torch.no_grad():
        per_step, hiddens = drafter.ttt_forward(ids, aux, steps, return_hidden=True)
        logits0, hidden0 = drafter(ids, aux_hidden=aux)
        torch.testing.assert_close(per_step[0], logits0, rtol=0, atol=0)
        torch.testing.assert_close(hiddens[0], hidden0, rtol=0, atol=0)
        # Step k at row r must equal decoding the drafter's own chain at position r+k
        # after a KV cache holding step-0 rows 0..r, which is what inference does.
        for r in (0, 3, t - steps):
            cache = DrafterKVCache()
            drafter(ids[:, : r + 1], aux_hidden=aux[:, : r + 1], kv_cache=cache)
            g = hiddens[0][:, r : r + 1]
            for k in range(1, steps):
                logits, g = drafter(ids[:, r + k : r + k + 1], g=g, kv_cache=cache)
                torch.testing.assert_close(logits[:, 0], per_step[k][:, r], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(per_step[1], per_step[0])


def test_eagle3_variant_residual_starts_from_g_and_embedding_is_frozen():
    drafter = tiny_drafter("eagle3", layers=1)
    assert not drafter.embed_tokens.weight.requires_grad
    assert drafter.layers[0].self_attn.q_proj.in_features == 64
    ids = torch.randint(0, 96, (1, 5))
    g = torch.randn(1, 5, 32)
    with torch.no_grad():
        _, hidden = drafter(ids, g=g)
        layer = drafter.layers[0]
        # Rebuild the single layer by hand: emb half first, residual from g.
        emb = drafter.embed_tokens(ids)
        a = torch.cat((layer.input_layernorm(emb), layer.hidden_norm(g)), -1)
        q, k, v = layer.self_attn.project(a, torch.arange(5)[None], drafter.inv_freq)
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)  # 4 query heads share 2 kv heads
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        expected = g + layer.self_attn.o_proj(attn.transpose(1, 2).reshape(1, 5, 32))
        expected = expected + layer.mlp(layer.post_attention_layernorm(expected))
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)


def test_plain_and_fused_eagle3_extra_layers_differ_in_shape():
    plain = tiny_drafter("eagle3", extra="plain")
    fused = tiny_drafter("eagle3", extra="fused")
    assert plain.layers[1].self_attn.q_proj.in_features == 32 and not hasattr(plain.layers[1], "hidden_norm")
    assert fused.layers[1].self_attn.q_proj.in_features == 64


def test_draft_vocab_mapping_round_trip():
    drafter = tiny_drafter("osprey", draft_vocab=10)
    ids = torch.tensor([3, 7, 11, 20, 33, 45, 50, 61, 80, 95])
    drafter.set_draft_vocab(ids[torch.randperm(10)])
    assert torch.equal(drafter.draft_to_target(torch.arange(10)), ids)
    assert drafter.t2d.sum() == 10 and bool(drafter.t2d[ids].all())
    full = drafter.target_logits(torch.arange(10.0)[None])
    assert torch.equal(full[0, ids], torch.arange(10.0)) and torch.isinf(full).sum() == 86


@pytest.mark.parametrize("variant,tied", [("osprey", False), ("osprey", True), ("eagle3", False)])
def test_save_load_round_trip_is_bit_identical(tmp_path, variant, tied):
    if tied:
        torch.manual_seed(3)
        cfg = DrafterConfig(32, 24, 2, 4, 2, 8, 48, 96, tie_word_embeddings=True, rope_scaling=dict(LLAMA3_ROPE))
        drafter = ReferenceDrafter(cfg).eval()
    else:
        drafter = tiny_drafter(variant)
    drafter.save_pretrained(tmp_path / "d")
    loaded = ReferenceDrafter.from_pretrained(tmp_path / "d").eval()
    assert loaded.config == drafter.config
    a, b = drafter.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    if tied:
        assert loaded.lm_head.weight.data_ptr() == loaded.embed_tokens.weight.data_ptr()
    ids, aux = torch.randint(0, 96, (1, 6)), torch.randn(1, 6, 72)
    with torch.no_grad():
        assert torch.equal(drafter(ids, aux_hidden=aux)[0], loaded(ids, aux_hidden=aux)[0])
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["config.json", "model.safetensors"]


def test_bad_config_and_missing_files_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="variant"):
        DrafterConfig(32, 24, 1, 4, 2, 8, 48, 96, variant="medusa")
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DrafterConfig(32, 24, 1, 4, 2, 8, 48, 96, draft_vocab_size=200)
    with pytest.raises(FileNotFoundError, match="config.json"):
        ReferenceDrafter.from_pretrained(tmp_path)
