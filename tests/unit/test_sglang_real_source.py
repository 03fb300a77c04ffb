"""The SGLang plugin and its CPU stand-in held to the source of the pinned sglang wheel (read with `ast`,
nothing imported): every name the plugin imports exists there, every call binds to the real signature,
every attribute it reads is set by the real class, and every stand-in signature equals the real one."""

import ast
from pathlib import Path

import pytest

from megatron_osprey.assets.sglang_wheel import SGLANG, sglang_wheel
from tests.sglang_source import SourceTree, binding_error, signature

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "megatron_osprey" / "export" / "sglang_plugin" / "eagle3_models.py"
STANDIN = ROOT / "tests" / "sglang_standin"
LLAMA, QWEN3 = "sglang.srt.models.llama", "sglang.srt.models.qwen3"
EAGLE3 = "sglang.srt.models.llama_eagle3"
LINEAR, NORM = "sglang.srt.layers.linear", "sglang.srt.layers.layernorm"
EMBED = "sglang.srt.layers.vocab_parallel_embedding"

# Calls the plugin makes on objects SGLang builds: (module, class, method, positional args, keywords).
METHOD_CALLS = (
    (LLAMA, "LlamaAttention", "forward", 0, {"positions", "hidden_states", "forward_batch"}),
    (QWEN3, "Qwen3Attention", "forward", 0, {"positions", "hidden_states", "forward_batch"}),
    (NORM, "RMSNorm", "forward", 1, set()),  # input_layernorm(side), hidden_norm(stream)
    (NORM, "RMSNorm", "forward", 2, set()),  # post_attention_layernorm(out, residual)
    (LLAMA, "LlamaMLP", "forward", 1, set()),
    (QWEN3, "Qwen3MLP", "forward", 1, set()),
    (LINEAR, "QKVParallelLinear", "weight_loader", 3, set()),  # (param, tensor, "q"|"k"|"v")
    (LINEAR, "MergedColumnParallelLinear", "weight_loader", 3, set()),  # (param, tensor, 0|1)
    (LINEAR, "RowParallelLinear", "weight_loader", 2, set()),
    (EMBED, "VocabParallelEmbedding", "weight_loader", 2, set()),
    (EMBED, "ParallelLMHead", "weight_loader", 2, set()),
    (EAGLE3, "LlamaForCausalLMEagle3", "set_embed", 1, set()),  # super().set_embed(embed)
)
# Attributes the plugin reads or replaces on SGLang's objects, each of which the real class must set.
ATTRIBUTES = {
    (LLAMA, "LlamaDecoderLayer"): {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"},
    (QWEN3, "Qwen3DecoderLayer"): {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"},
    (LLAMA, "LlamaAttention"): {"head_dim", "total_num_heads", "total_num_kv_heads", "qkv_proj", "o_proj"},
    (QWEN3, "Qwen3Attention"): {"head_dim", "total_num_heads", "total_num_kv_heads", "qkv_proj", "o_proj"},
    (LLAMA, "LlamaMLP"): {"down_proj"},
    (QWEN3, "Qwen3MLP"): {"down_proj"},
    (LINEAR, "RowParallelLinear"): {"reduce_results"},
}
# Reads the plugin writes exactly as stock SGLang's own EAGLE-3 draft does.
STOCK_EXPRESSIONS = (
    "get_parallel().pp_group",
    "get_spec().speculative_draft_window_size",
    "forward_batch.spec_info.hidden_states",
)
# Every (receiver, attribute) the plugin source reads, by where it is checked; a new one fails until listed.
CHECKED_ON_SGLANG = {
    ("layer", "self_attn"), ("layer", "mlp"), ("layer", "input_layernorm"), ("layer", "post_attention_layernorm"),
    ("attn", "head_dim"), ("attn", "total_num_heads"), ("attn", "total_num_kv_heads"), ("attn", "qkv_proj"),
    ("layer.self_attn", "o_proj"), ("layer.mlp", "down_proj"),
    ("layer.self_attn.o_proj", "reduce_results"), ("layer.mlp.down_proj", "reduce_results"),
    ("get_parallel()", "pp_group"), ("get_spec()", "speculative_draft_window_size"),
    ("forward_batch", "spec_info"), ("forward_batch.spec_info", "hidden_states"),
    ("super()", "set_embed"),
}  # fmt: skip
NOT_SGLANG = {
    # the HF config SGLang passes through, torch, Python
    ("config", "draft_vocab_size"), ("config", "hidden_size"), ("config", "rms_norm_eps"),
    ("config", "vocab_size"), ("logits_config", "vocab_size"), ("copy", "deepcopy"),
    ("embeds", "shape"), ("g", "chunk"), ("g", "shape"), ("tensor", "device"), ("tensor", "shape"),
    ("torch", "Tensor"), ("torch", "arange"), ("torch", "cat"),
    ("nn", "Linear"), ("nn", "Module"), ("nn", "ModuleList"), ("nn.Module", "__init__"), ("super()", "__init__"),
    ("layers", "append"), ("shards", "setdefault"), ("shards.setdefault()", "add"),
    # set by the plugin itself (hidden_norm on a fused layer) or nn.Module's
    ("layer", "hidden_norm"), ("self", "named_parameters"),
}  # fmt: skip


@pytest.fixture(scope="module")
def real():
    try:
        return SourceTree(sglang_wheel())
    except (OSError, RuntimeError) as error:  # no cached copy and no route to the package registry
        pytest.skip(f"{SGLANG.requirement} could not be fetched from the package registry: {error}")


@pytest.fixture(scope="module")
def standin():
    return SourceTree(STANDIN)


@pytest.fixture(scope="module")
def plugin():
    return ast.parse(PLUGIN.read_text(encoding="utf-8"))


def _imports(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """Local name -> (sglang module, name) for every `from sglang... import` of the plugin."""
    return {
        alias.asname or alias.name: (node.module, alias.name)
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang")
        for alias in node.names
    }


def _callable(tree: SourceTree, module: str, name: str) -> tuple[str, ast.FunctionDef, bool]:
    """(module, def, is_method) of what calling `name` runs: a function, or a class's __init__."""
    where, node = tree.resolve(module, name)
    if isinstance(node, ast.ClassDef):
        init_module, init = tree.method(module, name, "__init__")
        return init_module, init, True
    return where, node, False


def test_every_import_of_the_plugin_exists_in_the_real_release(real, plugin):
    imports = _imports(plugin)
    assert len(imports) >= 12, imports  # the plugin's SGLang surface is read, not an empty set
    for local, (module, name) in imports.items():
        real.resolve(module, name)  # raises LookupError naming the module and the missing name


def test_every_call_of_an_imported_name_binds_to_the_real_signature(real, plugin):
    imports = _imports(plugin)
    calls = [n for n in ast.walk(plugin) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    checked = 0
    for call in calls:
        if call.func.id not in imports or any(isinstance(a, ast.Starred) for a in call.args):
            continue
        module, name = imports[call.func.id]
        where, fn, is_method = _callable(real, module, name)
        params = real.signature(where, fn, drop_self=is_method)
        error = binding_error(params, len(call.args), {k.arg for k in call.keywords})
        assert error is None, f"line {call.lineno}: sglang {SGLANG.version} {module}.{name} {error}"
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("module,cls,method,n_positional,keywords", METHOD_CALLS)
def test_every_method_the_plugin_calls_binds_to_the_real_signature(real, module, cls, method, n_positional, keywords):
    where, fn = real.method(module, cls, method)
    error = binding_error(real.signature(where, fn, drop_self=True), n_positional, keywords)
    assert error is None, f"sglang {SGLANG.version} {cls}.{method} {error}"


@pytest.mark.parametrize("key", sorted(ATTRIBUTES))
def test_every_attribute_the_plugin_reads_is_set_by_the_real_class(real, key):
    missing = ATTRIBUTES[key] - real.instance_attributes(*key)
    assert not missing, f"sglang {SGLANG.version} {key[1]} sets no {sorted(missing)}"


def test_the_plugin_reads_runtime_state_as_stock_sglang_does(real, plugin):
    stock = {ast.unparse(n) for n in ast.walk(real.module(EAGLE3)) if isinstance(n, ast.Attribute)}
    ours = {ast.unparse(n) for n in ast.walk(plugin) if isinstance(n, ast.Attribute)}
    for expression in STOCK_EXPRESSIONS:
        assert expression in ours and expression in stock, expression


def test_every_attribute_read_in_the_plugin_is_checked_or_known_not_to_be_sglangs(plugin):
    def receiver(node):
        return ast.unparse(node.func) + "()" if isinstance(node, ast.Call) else ast.unparse(node)

    own = (
        {
            t.attr
            for n in ast.walk(plugin)
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"
        }
        | {n.name for n in ast.walk(plugin) if isinstance(n, ast.FunctionDef)}
        | {"make_layer"}
    )
    reads = {(receiver(n.value), n.attr) for n in ast.walk(plugin) if isinstance(n, ast.Attribute)}
    reads = {r for r in reads if not (r[0] == "self" and r[1] in own)}
    unclassified = reads - CHECKED_ON_SGLANG - NOT_SGLANG
    assert not unclassified, (
        f"classify these reads in this test (checked against sglang, or not SGLang's): {unclassified}"
    )


def test_the_plugin_sets_everything_the_stock_draft_init_sets(real, plugin):
    """The plugin skips the stock __init__ (nn.Module.__init__ instead), so it must set what SGLang reads later."""
    stock = real.init_assignments(EAGLE3, "LlamaForCausalLMEagle3")
    (cls,) = [n for n in plugin.body if isinstance(n, ast.ClassDef) and n.name == "OspreyLlamaForCausalLMEagle3"]
    (init,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    ours = {
        t.attr
        for n in ast.walk(init)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"
    }
    assert {"lm_head", "logits_processor", "hot_token_id"} <= stock
    assert stock <= ours, f"the stock __init__ also sets {sorted(stock - ours)}"


@pytest.mark.parametrize(
    "plugin_class,method,module,real_class",
    [
        ("OspreyLlamaForCausalLMEagle3", "load_weights", EAGLE3, "LlamaForCausalLMEagle3"),
        ("OspreyLlamaForCausalLMEagle3", "set_embed", EAGLE3, "LlamaForCausalLMEagle3"),
        ("OspreyLlamaForCausalLMEagle3", "get_hot_token_id", EAGLE3, "LlamaForCausalLMEagle3"),
        ("OspreyDraftModel", "forward", EAGLE3, "LlamaModel"),  # what LlamaForCausalLM.forward calls as self.model
    ],
)
def test_the_plugin_overrides_keep_the_real_signatures(real, plugin, plugin_class, method, module, real_class):
    (cls,) = [n for n in plugin.body if isinstance(n, ast.ClassDef) and n.name == plugin_class]
    (ours,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method]
    where, theirs = real.method(module, real_class, method)
    assert [p.name for p in signature(ours, True)] == [p.name for p in real.signature(where, theirs, True)]


def _standin_modules() -> list[str]:
    return sorted(
        ".".join(p.relative_to(STANDIN).with_suffix("").parts).removesuffix(".__init__") for p in STANDIN.rglob("*.py")
    )


def _public_names(tree: ast.Module) -> list[str]:
    names = [n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))]
    names += [
        alias.asname or alias.name
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("sglang")
        for alias in n.names
    ]
    names += [t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]
    return [n for n in names if not n.startswith("_") and n != "EntryClass"]


def _methods(tree: SourceTree, module: str, cls: str) -> set[str]:
    return {
        item.name
        for _, node in tree.class_chain(module, cls)
        for item in node.body
        if isinstance(item, ast.FunctionDef) and (item.name == "__init__" or not item.name.startswith("_"))
    }


@pytest.mark.parametrize("module", _standin_modules())
def test_every_standin_signature_equals_the_real_one(real, standin, module):
    assert real.has_module(module), f"sglang {SGLANG.version} has no module {module}"
    for name in _public_names(standin.module(module)):
        s_where, s_node = standin.resolve(module, name)
        r_where, r_node = real.resolve(module, name)  # LookupError: the stand-in invents a name
        if isinstance(s_node, ast.FunctionDef):
            assert standin.signature(s_where, s_node, False) == real.signature(r_where, r_node, False), name
        elif isinstance(s_node, ast.ClassDef):
            assert isinstance(r_node, ast.ClassDef), f"{module}.{name} is a class in the stand-in only"
            for method in _methods(standin, module, name):
                sm_where, sm = standin.method(module, name, method)
                rm_where, rm = real.method(module, name, method)
                ours, theirs = standin.signature(sm_where, sm, True), real.signature(rm_where, rm, True)
                assert ours == theirs, f"{module}.{name}.{method}: stand-in {ours} != sglang {theirs}"


def test_the_checker_catches_a_keyword_the_real_release_lacks(real):
    """Qwen3DecoderLayer has no stage_boundaries in 0.5.23 (LlamaDecoderLayer has): a call passing it is refused."""
    for cls, expected in (("LlamaDecoderLayer", None), ("Qwen3DecoderLayer", "has no parameter ['stage_boundaries']")):
        module = LLAMA if cls.startswith("Llama") else QWEN3
        where, init = real.method(module, cls, "__init__")
        params = real.signature(where, init, drop_self=True)
        assert binding_error(params, 2, {"quant_config", "prefix", "stage_boundaries"}) == expected
