"""Draft-OPD: the rollout store's recorded rounds, on-policy distillation from it, and its input errors."""

import pytest
import torch

from megatron_osprey.data.hidden_state_store import HiddenStateStore
from megatron_osprey.parallel import parallel_context
from megatron_osprey.stages.rollout import RolloutConfig
from megatron_osprey.stages.rollout import run as run_rollout
from megatron_osprey.testing.distill_setup import build_distill_setup, tiny_distill_config
from megatron_osprey.training.distillation import run_distill
from tests.distributed.scripts.check_on_policy import checkpoint_reference_state

STEPS, TOP_K = 3, 16


def sft_then_rollout(setup, root, max_new_tokens: int, limit: int, **sft_changes):
    """Distill online into ROOT/sft (the tiny config plus `sft_changes`), then roll it out into ROOT/rollout."""
    sft = tiny_distill_config(setup, checkpoint__save=str(root / "sft"), **sft_changes)
    with parallel_context(sft.parallel) as state:
        run_distill(sft, state)
    rollout = RolloutConfig(
        target=str(setup["target"]),
        drafter=str(root / "sft"),
        data_path=str(setup["data"]),
        output=str(root / "rollout"),
        steps=STEPS,
        top_k=TOP_K,
        max_new_tokens=max_new_tokens,
        limit=limit,
    )
    return run_rollout(rollout)


@pytest.fixture(scope="module")
def opd(tmp_path_factory):
    """An SFT-distilled drafter (online distillation, saved) and its rollout store over 8 training prompts."""
    setup = build_distill_setup(tmp_path_factory.mktemp("opd"))
    root = setup["root"]
    results = sft_then_rollout(setup, root, max_new_tokens=24, limit=8, training__train_iters=20)
    return {**setup, "sft": root / "sft", "store": root / "rollout", "results": results}


def test_recorded_target_distributions_equal_a_fresh_target_forward(opd):
    from transformers import AutoModelForCausalLM

    from megatron_osprey.speculative.rollout import fresh_target_distributions

    model = AutoModelForCausalLM.from_pretrained(str(opd["target"]), dtype=torch.float32).eval()
    store = HiddenStateStore(opd["store"])
    assert len(store) == 8 and store.header.rollout_steps == STEPS and store.header.rollout_top_k == TOP_K
    rounds_seen = rejected = 0
    worst = 0.0
    for i in range(len(store)):
        sample = store[i]
        rounds = sample["rollout"]
        assert len(rounds) == opd["results"].results[i].verify_count + opd["results"].replays[i]
        for r in range(len(rounds)):
            fresh = fresh_target_distributions(model, sample["input_ids"], rounds, r)  # [K, V] float64
            top = torch.topk(fresh, TOP_K, dim=-1)
            assert torch.equal(top.indices, rounds.topk_ids[r])
            worst = max(worst, float((top.values - rounds.topk_probs[r].double()).abs().max()))
            # accepted = the leading drafts equal to the target's argmax over the same tokens
            agree = (fresh.argmax(-1) == rounds.draft_tokens[r]).long()
            assert int(rounds.accepted[r]) == int(agree.cumprod(0).sum())
            rounds_seen += 1
            rejected += int(rounds.accepted[r]) < STEPS
    # float32 logits from an incremental KV cache against one fresh float32 forward
    assert worst < 1e-5, worst
    assert rounds_seen > 8 and rejected > 0  # the drafter is imperfect: there are rejections to learn from


def _live_and_replayed(rounds, prompt_length: int) -> tuple[list[int], list[int]]:
    """Indices of the live rounds (the first roots at the prompt's last row, each next one at t + a + 1) and
    of the others (the replays)."""
    live, replayed, expect = [], [], prompt_length - 1
    for r in range(len(rounds)):
        if int(rounds.root_rows[r]) == expect:
            live.append(r)
            expect = int(rounds.root_rows[r] + rounds.accepted[r]) + 1
        else:
            replayed.append(r)
    return live, replayed


def test_replays_redraft_each_rejection_position_from_the_verified_prefix(opd):
    """A live round rejected after a >= 1 accepted drafts gets one replay at root row t + a: its first step
    scores the rejected position again (the live round's distribution there), its drafts are the drafter's
    own chain from the verified prefix with the target's features (a fresh session and a fresh target forward)."""
    from transformers import AutoModelForCausalLM

    from megatron_osprey.eval.loading import load_drafter
    from megatron_osprey.speculative import ReferenceDraftSession
    from megatron_osprey.speculative.rollout import target_states

    model = AutoModelForCausalLM.from_pretrained(str(opd["target"]), dtype=torch.float32).eval()
    drafter = load_drafter(str(opd["sft"]), "--drafter").drafter.float()
    aux_ids = list(drafter.config.aux_layer_ids)
    store = HiddenStateStore(opd["store"])
    replays = worst = 0
    for i in range(len(store)):
        sample = store[i]
        ids, rounds = sample["input_ids"], sample["rollout"]
        live, replayed = _live_and_replayed(rounds, int((~sample["loss_mask"]).sum()))
        assert len(live) == opd["results"].results[i].verify_count and len(replayed) == opd["results"].replays[i]
        expected = {
            int(rounds.root_rows[r] + rounds.accepted[r]): r
            for r in live
            if 0 < int(rounds.accepted[r]) < STEPS and int(rounds.root_rows[r] + rounds.accepted[r]) + 1 < ids.numel()
        }
        assert [int(rounds.root_rows[r]) for r in replayed] == sorted(expected)
        for r in replayed:
            q, origin = int(rounds.root_rows[r]), expected[int(rounds.root_rows[r])]
            a = int(rounds.accepted[origin])
            assert torch.equal(rounds.topk_ids[r, 0], rounds.topk_ids[origin, a])
            worst = max(worst, float((rounds.topk_probs[r, 0] - rounds.topk_probs[origin, a]).abs().max()))
            session = ReferenceDraftSession(drafter)
            aux, _ = target_states(model, ids[: q + 1], aux_ids)
            logits, chain = session.start(ids[: q + 1], int(ids[q + 1]), aux), []
            for _ in range(STEPS):
                chain.append(int(logits.argmax()))
                logits = session.expand([len(chain) - 2], torch.tensor([chain[-1]]))[0]
            assert chain == rounds.draft_tokens[r].tolist()
            replays += 1
    assert worst < 1e-5, worst
    assert replays > 0


@pytest.fixture(scope="module")
def sampled(opd, tmp_path_factory):
    """The SFT drafter's rollouts at temperature 1.0 (speculative sampling): twice from seed 7, once from seed 8."""
    root = tmp_path_factory.mktemp("sampled")

    def roll(seed: int, name: str):
        config = RolloutConfig(
            target=str(opd["target"]),
            drafter=str(opd["sft"]),
            data_path=str(opd["data"]),
            output=str(root / name),
            steps=STEPS,
            top_k=TOP_K,
            max_new_tokens=24,
            limit=8,
            temperature=1.0,
            seed=seed,
        )
        return run_rollout(config)

    return {"runs": {"a": roll(7, "a"), "b": roll(7, "b"), "c": roll(8, "c")}, "root": root}


def test_sampled_rollouts_record_the_engines_decisions(opd, sampled):
    """Each live round's accepted drafts are the ones the sequence continues with, the next token is not the
    rejected draft, the distributions are a fresh target forward's, and replays sit at the rejection rows."""
    from transformers import AutoModelForCausalLM

    from megatron_osprey.speculative.rollout import fresh_target_distributions

    model = AutoModelForCausalLM.from_pretrained(str(opd["target"]), dtype=torch.float32).eval()
    store, run = HiddenStateStore(sampled["root"] / "a"), sampled["runs"]["a"]
    worst, accepted, rejected, replays = 0.0, 0, 0, 0
    for i in range(len(store)):
        sample = store[i]
        ids, rounds = sample["input_ids"], sample["rollout"]
        live, replayed = _live_and_replayed(rounds, int((~sample["loss_mask"]).sum()))
        assert len(live) == run.results[i].verify_count and len(replayed) == run.replays[i]
        for r in live:
            t, a, drafts = int(rounds.root_rows[r]), int(rounds.accepted[r]), rounds.draft_tokens[r]
            following = ids[t + 2 : t + 2 + STEPS]
            assert torch.equal(drafts[: min(a, following.numel())], following[:a])
            if a < min(STEPS, following.numel()):
                assert int(following[a]) != int(drafts[a])  # the token drawn in its place has no mass on it
            accepted += a
            rejected += a < STEPS
        expected = [
            int(rounds.root_rows[r] + rounds.accepted[r])
            for r in live
            if 0 < int(rounds.accepted[r]) < STEPS and int(rounds.root_rows[r] + rounds.accepted[r]) + 1 < ids.numel()
        ]
        assert [int(rounds.root_rows[r]) for r in replayed] == expected
        replays += len(replayed)
        for r in range(len(rounds)):
            top = torch.topk(fresh_target_distributions(model, ids, rounds, r), TOP_K, dim=-1)
            assert torch.equal(top.indices, rounds.topk_ids[r])
            worst = max(worst, float((top.values - rounds.topk_probs[r].double()).abs().max()))
    assert worst < 1e-5, worst
    assert accepted > 0 and rejected > 0 and replays > 0


def test_sampled_rollouts_follow_their_seed(opd, sampled):
    """The same seed gives the same store; another seed, or greedy decoding, another continuation."""
    stores = {name: HiddenStateStore(sampled["root"] / name) for name in "abc"}
    greedy = HiddenStateStore(opd["store"])

    def sequences(store):
        return [store[i]["input_ids"].tolist() for i in range(len(store))]

    assert sequences(stores["a"]) == sequences(stores["b"])
    for i in range(len(stores["a"])):
        for field in ("root_rows", "accepted", "draft_tokens", "topk_ids", "topk_probs"):
            assert torch.equal(getattr(stores["a"][i]["rollout"], field), getattr(stores["b"][i]["rollout"], field))
    assert sequences(stores["a"]) != sequences(stores["c"])
    assert sequences(stores["a"]) != sequences(greedy)


def test_rollout_sequence_is_the_target_greedy_output_with_its_states(opd):
    from transformers import AutoModelForCausalLM

    from megatron_osprey.speculative.rollout import target_states

    model = AutoModelForCausalLM.from_pretrained(str(opd["target"]), dtype=torch.float32).eval()
    store = HiddenStateStore(opd["store"])
    sample = store[0]
    ids, mask = sample["input_ids"], sample["loss_mask"]
    prompt = int((~mask).sum())
    greedy = model.generate(ids[None, :prompt], max_new_tokens=int(mask.sum()), do_sample=False)[0]
    assert torch.equal(greedy[: ids.numel()], ids)
    aux, _ = target_states(model, ids, [1, 3, 4])
    assert aux.shape[0] == sample["aux_hidden"].shape[0] and torch.isfinite(sample["aux_hidden"]).all()


def test_on_policy_distillation_runs_and_lowers_its_loss(opd):
    cfg = tiny_distill_config(
        opd,
        data__mode="on-policy",
        data__opd_form="offline",
        data__hidden_states=str(opd["store"]),
        drafter__drafter_init=str(opd["sft"]),
        ttt__ttt_steps=STEPS,
        training__train_iters=12,
    )
    with parallel_context(cfg.parallel) as state:
        result = run_distill(cfg, state)
    losses = [entry["loss/train"] for entry in result.history]
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    assert result.arch.variant == "osprey"


@pytest.mark.parametrize(
    "change,message",
    [
        ({"data__hidden_states": None}, "--opd-form offline needs --hidden-states"),
        ({"data__opd_form": "online"}, "--hidden-states: the online Draft-OPD form"),
        ({"data__opd_form": "online", "data__hidden_states": None, "data__data_path": []}, "one --data-path"),
        ({"data__opd_form": "online", "data__hidden_states": None, "data__opd_round_updates": 0}, "--opd-round"),
        (
            {"data__opd_form": "online", "data__hidden_states": None, "target__expert_model_parallel_size": 2},
            "--target-expert-model-parallel-size: .* HF rollout .* --opd-target-backend megatron",
        ),
        (
            {"data__opd_form": "online", "data__hidden_states": None, "data__opd_target_backend": "vllm"},
            "--opd-target-backend must be one of",
        ),
        ({"drafter__drafter_init": None, "drafter__baseline": "eagle3"}, "--drafter-init DISTILL_SAVE_DIR"),
        ({"drafter__drafter_init": "ADAPTED"}, "--drafter-init .*no latest_checkpointed_iteration.txt"),
    ],
)
def test_on_policy_bad_input_names_the_flag(opd, change, message):
    cfg = tiny_distill_config(
        opd, data__mode="on-policy", data__opd_form="offline", data__hidden_states=str(opd["store"])
    )
    cfg.drafter.drafter_init = str(opd["sft"])
    for key, value in change.items():
        section, field = key.split("__")
        setattr(getattr(cfg, section), field, str(opd["drafter"]) if value == "ADAPTED" else value)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        cfg.validate(world_size=1)


class _RecordingRollout:
    """The stage's OnlineRollout, recording the reference drafter each round rolls out with."""

    def __init__(self, inner):
        self.inner, self.prompts, self.states, self.indices = inner, inner.prompts, [], []

    def __call__(self, model, indices):
        from megatron.core.utils import unwrap_model

        from megatron_osprey.speculative.online_rollout import live_reference_drafter

        self.states.append(
            {k: v.clone() for k, v in live_reference_drafter(unwrap_model(model[0])).state_dict().items()}
        )
        self.indices.append(list(indices))
        self.samples = self.inner(model, indices)
        return self.samples


def test_online_opd_rounds_roll_out_the_drafter_the_previous_round_left(opd, tmp_path):
    """The authors' loop on the tiny target, 2 rounds of 1 update: round 0 rolls out with the SFT drafter,
    round 1 with the weights the first update saved (iteration 1), and both rounds' samples are the target's
    greedy continuations of their prompts, trained on with the offline TTT loss."""
    from megatron_osprey.stages.distill import online_rollout

    cfg = tiny_distill_config(
        opd,
        data__mode="on-policy",
        data__opd_max_new_tokens=12,
        drafter__drafter_init=str(opd["sft"]),
        ttt__ttt_steps=STEPS,
        training__train_iters=2,
        checkpoint__save=str(tmp_path / "opd"),
        checkpoint__save_interval=1,
    )
    cfg.validate(world_size=1)
    with parallel_context(cfg.parallel) as state:
        recorder = _RecordingRollout(online_rollout(cfg, state))
        result = run_distill(cfg, state, recorder)
    losses = [entry["loss/train"] for entry in result.history]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert len(recorder.states) == 2 and len(recorder.inner.summaries) == 2
    per_round = cfg.training.global_batch_size
    assert [len(i) for i in recorder.indices] == [per_round, per_round]
    assert set(recorder.indices[0]).isdisjoint(recorder.indices[1])  # the epoch order goes on
    sft = checkpoint_reference_state(opd["sft"], None)
    after_first = checkpoint_reference_state(tmp_path / "opd", 1)
    for name, value in recorder.states[0].items():
        assert torch.equal(value, sft[name]), name
    for name, value in recorder.states[1].items():
        assert torch.equal(value, after_first[name]), name
    assert any(not torch.equal(recorder.states[1][n], sft[n]) for n in sft)  # the update moved the drafter
    # temperature 0: a round's sample is the target's greedy continuation of its prompt, with its states
    sample, model = recorder.samples[0], recorder.inner.target.model
    prompt = int((~sample["loss_mask"]).sum())
    greedy = model.generate(sample["input_ids"][None, :prompt], max_new_tokens=12, do_sample=False)[0]
    assert torch.equal(greedy[: sample["input_ids"].numel()], sample["input_ids"]) and sample["loss_mask"].sum() > 0
    assert sample["aux_hidden"].shape == (sample["input_ids"].numel(), 3 * 64)


def test_online_opd_needs_the_stages_rollout(opd):
    cfg = tiny_distill_config(opd, data__mode="on-policy", drafter__drafter_init=str(opd["sft"]), ttt__ttt_steps=2)
    with parallel_context(cfg.parallel) as state, pytest.raises(ValueError, match="needs the stage's OnlineRollout"):
        run_distill(cfg, state)


def test_on_policy_refuses_a_store_without_rollouts(opd, tmp_path):
    from megatron_osprey.data.hidden_state_store import HiddenStateWriter, finalize_store

    store = HiddenStateStore(opd["store"])
    h = store.header
    plain = tmp_path / "plain"
    with HiddenStateWriter(
        plain, target_id=h.target_id, config_hash=h.config_hash, aux_layer_ids=h.aux_layer_ids, hidden_size=64
    ) as writer:
        sample = store[0]
        writer.add("s0", sample["input_ids"], sample["loss_mask"], sample["aux_hidden"], sample["final_hidden"])
    finalize_store(plain)
    cfg = tiny_distill_config(
        opd,
        data__mode="on-policy",
        data__opd_form="offline",
        data__hidden_states=str(plain),
        drafter__drafter_init=str(opd["sft"]),
    )
    with parallel_context(cfg.parallel) as state, pytest.raises(ValueError, match="--hidden-states .* no rollout"):
        run_distill(cfg, state)


def test_the_ttt_unroll_redrafts_each_recorded_round(opd):
    """With the rollout's own weights, step k of a root row proposes exactly the recorded draft d_{k+1}: the
    unroll re-drafts the rounds (TTT's attention sees the verified prefix and the row's own earlier steps)."""
    from megatron_osprey.losses.ttt import drafter_inputs
    from megatron_osprey.models.drafter.model import build_drafter_model
    from megatron_osprey.training.checkpointing import load_backbone_weights
    from megatron_osprey.training.distillation import distilled_arch
    from megatron_osprey.training.on_policy import draft_step_ids, pad_rollout_samples

    store = HiddenStateStore(opd["store"])
    arch = distilled_arch(str(opd["sft"]))
    cfg = tiny_distill_config(opd)
    with parallel_context(cfg.parallel) as state, torch.no_grad():
        model = build_drafter_model(arch, state.config, transformer_impl="local", params_dtype=torch.float32)
        load_backbone_weights(str(opd["sft"]), [model])
        batch = pad_rollout_samples([store[i] for i in range(4)], 64, 0, 16, STEPS)
        inputs, roots = drafter_inputs(batch["input_ids"]), batch["rollout_roots"]
        step_ids = draft_step_ids(inputs, roots, batch["rollout_drafts"], STEPS)
        aux = batch["aux_hidden"].float()
        logits, _ = model.ttt_forward(inputs, aux, STEPS, [roots] * STEPS, step_ids=step_ids)
        proposed = torch.stack([logits_k.argmax(-1) + model.d2t[logits_k.argmax(-1)] for logits_k in logits], dim=1)
    assert roots.sum() > 8
    assert torch.equal(proposed, batch["rollout_drafts"])


def test_eagle3_goes_through_the_same_rollout_and_on_policy_training(opd, tmp_path):
    """An EAGLE-3 drafter with a reduced draft vocabulary (the top-k ids are mapped into it): SFT, rollout, OPD."""
    sft_then_rollout(
        opd,
        tmp_path,
        max_new_tokens=12,
        limit=4,
        drafter__drafter_init=None,
        drafter__baseline="eagle3",
        drafter__draft_vocab_size=64,
        training__train_iters=6,
    )
    cfg = tiny_distill_config(
        opd,
        data__mode="on-policy",
        data__opd_form="offline",
        data__hidden_states=str(tmp_path / "rollout"),
        drafter__drafter_init=str(tmp_path / "sft"),
        ttt__ttt_steps=STEPS,
        training__train_iters=3,
    )
    with parallel_context(cfg.parallel) as state:
        result = run_distill(cfg, state)
    assert result.arch.variant == "eagle3" and result.arch.draft_vocab_size == 64
    assert all(torch.isfinite(torch.tensor(entry["loss/train"])) for entry in result.history)
    assert all(entry["ploss/0"] > 0 for entry in result.history)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"target_backend": "vllm"}, "--target-backend must be one of"),
        ({"parallel": {"tensor_model_parallel_size": 2}}, "--tensor-model-parallel-size shards the Megatron target"),
        ({"parallel": {"expert_model_parallel_size": 2}}, "--expert-model-parallel-size shards the Megatron target"),
        ({"parallel": {"sequence_parallel": True}}, "--sequence-parallel shards the Megatron target"),
    ],
)
def test_rollout_bad_backend_flags_name_the_flag(opd, tmp_path, change, message):
    from megatron_osprey.parallel.config import ParallelConfig

    if "parallel" in change:
        change = {"parallel": ParallelConfig(**change["parallel"])}
    config = RolloutConfig(
        target=str(opd["target"]), drafter=str(opd["sft"]), data_path=str(opd["data"]), output=str(tmp_path / "o")
    )
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=message):
        config.validate()


def test_rollout_and_extract_take_the_expert_layout_flags():
    """Megatron-LM's names, as the stages' docstrings show them (extract's had no such flag before)."""
    from megatron_osprey.stages.cli import parse_config
    from megatron_osprey.stages.extract import FLAGS as EXTRACT_FLAGS
    from megatron_osprey.stages.extract import ExtractConfig
    from megatron_osprey.stages.rollout import FLAGS as ROLLOUT_FLAGS

    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"]
    layout += ["--expert-tensor-parallel-size", "1"]
    for name, cls, flags in (("rollout", RolloutConfig, ROLLOUT_FLAGS), ("extract", ExtractConfig, EXTRACT_FLAGS)):
        config, _ = parse_config(layout, name, cls, flags, "", None)
        p = config.parallel
        assert (p.tensor_model_parallel_size, p.sequence_parallel) == (2, True)
        assert (p.expert_model_parallel_size, p.expert_tensor_parallel_size) == (2, 1)


def test_a_moe_rollout_at_tp2_needs_sequence_parallel(tmp_path):
    from megatron_osprey.base.arch import ModelArch
    from megatron_osprey.parallel.config import ParallelConfig
    from megatron_osprey.stages.rollout import _check_megatron_layout
    from megatron_osprey.testing.tiny_models import write_chat_target

    write_chat_target(tmp_path / "moe", "qwen3_moe")
    config = RolloutConfig(parallel=ParallelConfig(tensor_model_parallel_size=2), target_backend="megatron")
    with pytest.raises(ValueError, match="needs --sequence-parallel"):
        _check_megatron_layout(config, ModelArch.from_hf_config(tmp_path / "moe"))
    config.parallel = ParallelConfig(expert_model_parallel_size=3)
    with pytest.raises(ValueError, match="--expert-model-parallel-size 3 does not divide"):
        _check_megatron_layout(config, ModelArch.from_hf_config(tmp_path / "moe"))


def _resumable(opd, output, **changes) -> RolloutConfig:
    config = RolloutConfig(
        target=str(opd["target"]),
        drafter=str(opd["sft"]),
        data_path=str(opd["data"]),
        output=str(output),
        steps=STEPS,
        top_k=TOP_K,
        max_new_tokens=24,
        limit=8,
        samples_per_shard=3,
    )
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def test_an_interrupted_rollout_resumes_to_the_uninterrupted_store(opd, tmp_path, monkeypatch):
    """Killed at the fifth prompt, the rerun keeps the complete shard (3 prompts), rolls out the other 5, and the
    store equals the uninterrupted one (opd's, same settings but the shard size) sample by sample."""
    import megatron_osprey.speculative.rollout as engine

    real, calls = engine.rollout, []

    def killed_at_the_fifth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "rollout", killed_at_the_fifth)
    with pytest.raises(RuntimeError, match="killed"):
        run_rollout(_resumable(opd, tmp_path / "r"))
    monkeypatch.setattr(engine, "rollout", real)
    resumed = run_rollout(_resumable(opd, tmp_path / "r"))
    assert resumed.skipped == 3 and len(resumed.results) == 5
    store, whole = HiddenStateStore(tmp_path / "r"), HiddenStateStore(opd["store"])
    by_id = {whole[i]["sample_id"]: whole[i] for i in range(len(whole))}
    assert len(store) == len(whole) == 8
    for i in range(len(store)):
        got = store[i]
        want = by_id[got["sample_id"]]
        for key in ("input_ids", "loss_mask", "aux_hidden", "final_hidden"):
            assert torch.equal(got[key], want[key]), key
        for field in ("root_rows", "accepted", "draft_tokens", "topk_ids", "topk_probs"):
            assert torch.equal(getattr(got["rollout"], field), getattr(want["rollout"], field)), field


def test_a_rollout_store_from_other_settings_is_refused_or_replaced(opd, tmp_path, capsys):
    from megatron_osprey.stages.rollout import claim_store

    run_rollout(_resumable(opd, tmp_path / "r", limit=3))
    again = run_rollout(_resumable(opd, tmp_path / "r", limit=3))  # the same settings: everything is stored
    assert again.skipped == 3 and again.results == []
    with pytest.raises(
        ValueError, match=r"holds rollouts from other inputs or settings \(steps: 3 -> 2\).*--overwrite"
    ):
        run_rollout(_resumable(opd, tmp_path / "r", limit=3, steps=2))
    with pytest.raises(ValueError, match=r"writers \(data-parallel replicas\): 1 -> 2"):  # another layout
        claim_store(_resumable(opd, tmp_path / "r", limit=3), replicas=2)
    fresh = run_rollout(_resumable(opd, tmp_path / "r", limit=3, steps=2, overwrite=True))
    assert fresh.skipped == 0 and len(fresh.results) == 3
    assert "rollout: --overwrite: deleting" in capsys.readouterr().out
    assert HiddenStateStore(tmp_path / "r").header.rollout_steps == 2
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a rollout")
    with pytest.raises(ValueError, match="so this stage did not write it"):
        run_rollout(_resumable(opd, tmp_path / "mine", limit=3, overwrite=True))
    assert (tmp_path / "mine" / "notes.txt").is_file()
