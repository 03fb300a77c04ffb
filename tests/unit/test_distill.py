"""Stage 4: online == offline on the same batch, a short run raises acc_0, the EAGLE-3 baseline, errors."""

import functools

import pytest
import torch

from megatron_osprey.data.distill_data import ConversationSamples, StoreSamples, pad_samples
from megatron_osprey.data.micro_batches import micro_batches
from megatron_osprey.models.target.lm_head import TargetHead
from megatron_osprey.models.target.online import OnlineTarget
from megatron_osprey.parallel import ParallelConfig, parallel_context
from megatron_osprey.testing.distill_setup import build_distill_setup, tiny_distill_config, write_topic_conversations
from megatron_osprey.training.distillation import distill_forward_step, run_distill


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return build_distill_setup(tmp_path_factory.mktemp("distill"))


def test_short_distillation_raises_acc0(setup):
    cfg = tiny_distill_config(setup, training__train_iters=30)
    with parallel_context(cfg.parallel) as state:
        result = run_distill(cfg, state)
    acc = [entry["acc/0"] for entry in result.history]
    accept = [entry["accept/0"] for entry in result.history]
    assert len(acc) == 30
    assert acc[0] < 0.05
    assert sum(acc[-5:]) / 5 > 0.2  # far above the start
    assert sum(accept[-5:]) / 5 > accept[0] + 0.3
    assert result.history[-1]["loss/train"] < result.history[0]["loss/train"]


def extract_store(setup, arch, store_dir, state) -> None:
    """The tiny target's float32 hidden-state store of the training data, at the drafter's aux layers."""
    from megatron_osprey.base.arch import ModelArch
    from megatron_osprey.data.extract import extract_hidden_states
    from megatron_osprey.data.hidden_state_store import HiddenStateStoreConfig
    from megatron_osprey.models.target.config import TargetConfig
    from megatron_osprey.stages.extract import ExtractConfig

    extract_hidden_states(
        ExtractConfig(
            target=TargetConfig(path=str(setup["target"])),
            data_path=str(setup["data"]),
            store=HiddenStateStoreConfig(store_dir=str(store_dir)),
            aux_layer_ids=list(arch.aux_layer_ids),
            max_length=64,
            params_dtype="float32",
        ),
        state,
        ModelArch.from_hf_config(setup["target"]),
        log=lambda _: None,
    )


def test_online_equals_offline_on_the_same_batch(setup, tmp_path):
    from transformers import AutoTokenizer

    from megatron_osprey.base.run_config import load_run_config
    from megatron_osprey.models.drafter.model import DrafterArch, build_drafter_model
    from megatron_osprey.training.checkpointing import load_backbone_weights

    cfg = tiny_distill_config(setup)
    arch = DrafterArch.from_dict(load_run_config(setup["drafter"])["drafter"])
    store_dir = tmp_path / "store"
    with parallel_context(ParallelConfig()) as state:
        extract_store(setup, arch, store_dir, state)
        model = build_drafter_model(arch, state.config)
        load_backbone_weights(setup["drafter"] / "megatron", [model])
        head = TargetHead.from_hf(setup["target"], model.t2d)
        target = OnlineTarget(setup["target"], state.config, state.device, arch.aux_layer_ids)
        online_source = ConversationSamples([str(setup["data"])], AutoTokenizer.from_pretrained(setup["target"]), 64)
        offline_source = StoreSamples(store_dir)
        by_id = {offline_source[i]["sample_id"]: i for i in range(len(offline_source))}
        picks = [0, 3]
        online = pad_samples([online_source[i] for i in picks], 64, 0)
        offline = pad_samples([offline_source[by_id[online_source[i]["sample_id"]]] for i in picks], 64, 0)
        assert torch.equal(online["input_ids"], offline["input_ids"])
        assert torch.equal(online["loss_mask"], offline["loss_mask"])

        # Online = offline shares the target code on both sides: hold the online states to HF's own
        # output_hidden_states (layer i's output is hidden_states[i + 1]; the last one is normed, so
        # the final pre-norm state comes from a hook on the last layer).
        aux_online, final_online = target(online["input_ids"])
        hf_error = hf_hidden_state_error(
            setup["target"], online["input_ids"], arch.aux_layer_ids, aux_online, final_online
        )
        print(f"online target vs HF output_hidden_states: max |difference| = {hf_error:.2e}")
        assert hf_error < 1e-6  # measured 6.0e-8 (float32 summation order)

        def rounded_target(ids):  # the store keeps bf16: round the online states the same way
            aux, final = target(ids)
            return aux.bfloat16().float(), final.bfloat16().float()

        losses = {}
        for name, batch, fn in (
            ("online", online, rounded_target),
            ("offline", offline, None),
            ("online_fp32", online, target),
        ):
            step = distill_forward_step(fn, head, cfg, arch.draft_vocab_size, None)
            with torch.no_grad():
                losses[name] = step(iter([batch]), model)[0].item()
    assert losses["offline"] > 0
    assert abs(losses["online"] - losses["offline"]) < 1e-5 * losses["offline"]
    assert abs(losses["online_fp32"] - losses["offline"]) < 1e-2 * losses["offline"]  # bf16 storage only


def test_batch_length_padding_gives_the_fixed_length_loss(setup, tmp_path):
    """Padding a micro-batch only to its longest sample (rounded to 16) leaves the TTT loss unchanged."""
    from transformers import AutoTokenizer

    from megatron_osprey.base.run_config import load_run_config
    from megatron_osprey.models.drafter.model import DrafterArch, build_drafter_model
    from megatron_osprey.training.checkpointing import load_backbone_weights

    cfg = tiny_distill_config(setup)
    arch = DrafterArch.from_dict(load_run_config(setup["drafter"])["drafter"])
    with parallel_context(ParallelConfig()) as state:
        model = build_drafter_model(arch, state.config)
        load_backbone_weights(setup["drafter"] / "megatron", [model])
        head = TargetHead.from_hf(setup["target"], model.t2d)
        target = OnlineTarget(setup["target"], state.config, state.device, arch.aux_layer_ids)
        source = ConversationSamples([str(setup["data"])], AutoTokenizer.from_pretrained(setup["target"]), 256)
        samples = [source[i] for i in (1, 2)]
        short = pad_samples(samples, 256, 0, multiple=16)
        full = pad_samples(samples, 256, 0)
        assert short["input_ids"].shape[1] < 256 and short["input_ids"].shape[1] % 16 == 0
        losses = {}
        for name, batch in (("short", short), ("full", full)):
            step = distill_forward_step(target, head, cfg, arch.draft_vocab_size, None)
            with torch.no_grad():
                loss, reduce = step(iter([batch]), model)
            losses[name] = (loss.item(), int(reduce(loss)[1]))
    assert losses["full"][0] > 0
    assert abs(losses["short"][0] - losses["full"][0]) <= 1e-5 * losses["full"][0], losses
    assert losses["short"][1] == losses["full"][1]  # the same counted rows


def hf_hidden_state_error(target_dir, input_ids, aux_layer_ids, aux, final) -> float:
    """Largest |difference| between the online target's states and the HF model's own."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    captured = []
    hook = hf.model.layers[-1].register_forward_hook(
        lambda m, i, o: captured.append(o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        hidden = hf(input_ids, output_hidden_states=True).hidden_states
    hook.remove()
    assert len(hidden) == hf.config.num_hidden_layers + 1
    expected_aux = torch.cat([hidden[i + 1] for i in aux_layer_ids], dim=-1)
    return max((aux - expected_aux).abs().max().item(), (final - captured[0]).abs().max().item())


def test_eagle3_baseline_through_the_same_entry(setup):
    cfg = tiny_distill_config(setup, training__train_iters=3, drafter__baseline="eagle3", drafter__draft_vocab_size=64)
    cfg.drafter.drafter_init = None
    from safetensors.torch import load_file

    with parallel_context(cfg.parallel) as state:
        result = run_distill(cfg, state)
    assert result.arch.variant == "eagle3" and result.arch.draft_vocab_size == 64
    assert result.arch.body.hidden_size == 64 and result.arch.body.num_layers == 1  # the target's layer shape
    assert len(result.history) == 3
    target_embedding = load_file(setup["target"] / "model.safetensors")["model.embed_tokens.weight"]
    assert target_embedding.shape[0] == result.arch.vocab_size


def test_data_order_is_a_function_of_consumed_samples(setup):
    from transformers import AutoTokenizer

    source = ConversationSamples([str(setup["data"])], AutoTokenizer.from_pretrained(setup["target"]), 64)
    collate = functools.partial(pad_samples, seq_length=64, pad_id=0)
    straight = micro_batches(source, 0, 2, 0, 1, collate, seed=3, shuffle=True)
    batches = [next(straight)["input_ids"] for _ in range(30)]  # crosses an epoch (48 samples)
    resumed = micro_batches(source, 2 * 20, 2, 0, 1, collate, seed=3, shuffle=True)
    assert all(torch.equal(batches[20 + i], next(resumed)["input_ids"]) for i in range(10))
    rank1 = micro_batches(source, 0, 2, 1, 2, collate, seed=3, shuffle=True)  # DP rank 1 takes the second micro-batch
    assert torch.equal(next(rank1)["input_ids"], batches[1])


@pytest.mark.parametrize(
    "change,message",
    [
        ({"drafter__baseline": "eagle3"}, "exactly one of --drafter-init"),
        ({"data__mode": "offline"}, "--mode offline needs --hidden-states"),
        ({"data__data_path": ["/no/such.jsonl"]}, "--data-path /no/such.jsonl does not exist"),
        ({"parallel__pipeline_model_parallel_size": 2}, "--pipeline-model-parallel-size 1"),
    ],
)
def test_clear_errors(setup, change, message):
    cfg = tiny_distill_config(setup, **change)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        cfg.validate(world_size=2)


def test_offline_refuses_a_store_from_another_target_of_the_same_shape(setup, tmp_path):
    from transformers import AutoTokenizer

    from megatron_osprey.base.arch import ModelArch
    from megatron_osprey.base.run_config import load_run_config
    from megatron_osprey.data.hidden_state_store import StoreMismatchError
    from megatron_osprey.models.drafter.model import DrafterArch
    from megatron_osprey.testing.distill_setup import write_chat_model
    from megatron_osprey.training.distillation import assistant_token_counts, build_sources

    arch = DrafterArch.from_dict(load_run_config(setup["drafter"])["drafter"])
    store_dir = tmp_path / "store"
    with parallel_context(ParallelConfig()) as state:
        extract_store(setup, arch, store_dir, state)
    # Same family, layers, width and tokenizer as the store's target; other weights (another seed).
    twin = write_chat_model(tmp_path / "twin", "qwen3", layers=8, hidden=64, seed=7)
    tokenizer = AutoTokenizer.from_pretrained(setup["target"])
    cfg = tiny_distill_config(setup, data__mode="offline", data__hidden_states=str(store_dir))
    source = build_sources(cfg, arch, ModelArch.from_hf_config(setup["target"]), tokenizer)  # its own: accepted
    online = ConversationSamples([str(setup["data"])], tokenizer, 64)
    # The token counts come from the store's ids and masks alone and equal the conversations' own.
    assert torch.equal(assistant_token_counts(source, arch.vocab_size), assistant_token_counts(online, arch.vocab_size))
    cfg.target.path = str(twin)
    with pytest.raises(StoreMismatchError, match="config_hash"):
        build_sources(cfg, arch, ModelArch.from_hf_config(twin), tokenizer)


def test_no_surviving_loss_tokens_is_refused_and_survivors_are_reported(setup, tmp_path):
    import json

    prompts_only = tmp_path / "prompts.jsonl"
    long_prompt = "word " * 200  # far beyond --seq-length 64: its answer is cut off
    with open(prompts_only, "w") as handle:
        handle.write(json.dumps({"id": "p0", "conversations": [{"role": "user", "content": "Hello?"}]}) + "\n")
        handle.write(
            json.dumps(
                {
                    "id": "p1",
                    "conversations": [
                        {"role": "user", "content": long_prompt},
                        {"role": "assistant", "content": "Fine."},
                    ],
                }
            )
            + "\n"
        )
    cfg = tiny_distill_config(setup, data__data_path=[str(prompts_only)], training__train_iters=2)
    with parallel_context(cfg.parallel) as state:
        with pytest.raises(ValueError, match=r"none of its 2 samples keeps an assistant token within --seq-length 64"):
            run_distill(cfg, state)
    # One good conversation among them: the run goes ahead and says how much data survived.
    with open(prompts_only, "a") as handle:
        handle.write(
            json.dumps(
                {
                    "id": "p2",
                    "conversations": [
                        {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello there."},
                    ],
                }
            )
            + "\n"
        )
    with parallel_context(cfg.parallel) as state:
        result = run_distill(cfg, state)
    survivors = [n for n in result.notes if "samples keep assistant tokens" in n]
    assert len(survivors) == 1 and survivors[0].startswith(
        "1 of 3 samples keep assistant tokens within --seq-length 64"
    )
    assert result.state.iteration == 2


def test_store_loss_masks_are_read_without_hidden_states_and_match_the_samples(tmp_path):
    from megatron_osprey.data.distill_data import loss_token_survivors
    from megatron_osprey.data.hidden_state_store import HiddenStateWriter, finalize_store

    g = torch.Generator().manual_seed(0)
    with HiddenStateWriter(
        tmp_path, target_id="t", config_hash="h", aux_layer_ids=(1, 2, 3), hidden_size=8, samples_per_shard=2
    ) as writer:
        for i, length in enumerate([5, 9, 3]):
            mask = torch.zeros(length, dtype=torch.bool)
            mask[length - 2 :] = i != 2  # sample 2 has no loss tokens
            writer.add(
                f"s{i}",
                torch.arange(length),
                mask,
                torch.randn(length, 24, generator=g),
                torch.randn(length, 8, generator=g),
            )
    finalize_store(tmp_path)
    source = StoreSamples(tmp_path)
    masks = list(source.loss_masks())
    assert [m.tolist() for m in masks] == [source[i]["loss_mask"].tolist() for i in range(3)]
    assert loss_token_survivors(source, seq_length=64) == (2, 4)
    assert loss_token_survivors(source, seq_length=6) == (1, 2)  # sample 1's loss tokens sit at 7 and 8


# --- distill --eval-data DOMAIN=FILE: the held-out TTT loss per domain at every --eval-interval, as the release's
# --eval-data (LeanModels/Osprey scripts/osprey/run_adaptation.py), logged like the training loss.


def test_each_domain_held_out_loss_is_logged_at_every_eval_interval(setup, tmp_path):
    held_out = write_topic_conversations(tmp_path / "chat.jsonl", 8)  # 2 global batches of 4
    other = write_topic_conversations(tmp_path / "other.jsonl", 4, seed=7)
    cfg = tiny_distill_config(
        setup,
        training__train_iters=4,
        logging__eval_interval=2,
        logging__tensorboard_dir=str(tmp_path / "tb"),
        data__eval_data=[f"chat={held_out}", f"same={held_out}", f"other={other}"],
    )
    with parallel_context(cfg.parallel) as state:
        result = run_distill(cfg, state)
    merged = {}  # one history entry per held-out set and evaluation
    for h in result.history:
        if any(key.startswith("loss/valid/") for key in h):
            merged.setdefault(h["iteration"], {}).update(h)
    assert sorted(merged) == [2, 4]
    valid = [merged[2], merged[4]]
    for h in valid:
        # In order and deterministic: the same file under two names gives the same loss; another file another.
        assert h["loss/valid/chat"] == h["loss/valid/same"] != h["loss/valid/other"]
        # The 0.8^k-weighted sum over 5 TTT steps: about 3.36 x the per-step loss (measured 22.8, then 21.4).
        assert 0 < h["loss/valid/chat"] < 40 and 0 <= h["valid/chat/acc/0"] <= 1 and "valid/other/ploss/4" in h
    assert valid[0]["loss/valid/chat"] != valid[1]["loss/valid/chat"]  # the drafter moved between the two
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    logged = events.Scalars("loss/valid/chat")
    assert [e.step for e in logged] == [2, 4]
    assert logged[1].value == pytest.approx(valid[1]["loss/valid/chat"], rel=1e-6)  # TB stores float32
    assert "loss/train" in events.Tags()["scalars"]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"data__eval_data": ["chat"]}, r"--eval-data 'chat' must be DOMAIN=FILE"),
        ({"data__eval_data": ["a=x.jsonl", "a=y.jsonl"]}, r"--eval-data 'a=y.jsonl' must be DOMAIN=FILE, one per"),
        ({"data__eval_data": ["chat=missing.jsonl"]}, r"--eval-data chat=missing.jsonl: missing.jsonl does not exist"),
        ({"data__eval_data": ["chat=x"], "data__mode": "offline", "data__hidden_states": "s"}, r"use --mode online"),
    ],
)
def test_bad_eval_data_is_refused_naming_the_flag(setup, changes, message):
    cfg = tiny_distill_config(setup, **changes)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        cfg.validate(1)
