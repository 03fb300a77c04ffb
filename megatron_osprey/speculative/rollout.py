"""Target-assisted rollout for Draft-OPD: chain speculative decoding that records every verify round.

The continuation is the target's own (lossless: every emitted token is verified; greedy, or sampled at a
temperature by speculative sampling, whose output is distributed as the target's), so the rollout never
leaves the target's distribution; what it records is where the drafter's own proposals lead. Each verify
round gives (data/hidden_state_store/rollout.py has the store layout):

* the root row n - 1 (x_0..x_n verified, x_n not yet in the target's cache), the drafted d_1..d_K;
* the target's distribution at each drafted position j = 0..K-1 (after x_0..x_n, d_1..d_j): the verify
  forward's own logits, kept as the top-k probabilities of the full-vocabulary softmax at temperature 1
  (float32), what distillation matches whatever temperature the rollout samples at;
* how many drafts the target accepted: greedy, the leading drafts equal to its argmax; sampled, the drafts
  the rejection-sampling rule kept (the engine's own decision, taken from its commit; a replay's, drawn by
  the same rule).

It wraps the engine's target (a TargetModel), so the engine itself is unchanged: `speculative_generate`
drives the recording target exactly as it drives the plain one; any TargetModel serves (the HF model, or the
Megatron-Core one on a rank or a tensor-parallel group).

Each round already records the target on the drafter's own proposals, accepted and rejected: positions past
the rejection lie along the rejected draft. The next live round drafts from just after the correction token.
What no live round shows is the drafter re-drafting the rejected position itself from the verified prefix
(with the target's features of the accepted drafts instead of its own): replay_rejections adds that round.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from megatron_osprey.data.hidden_state_store.rollout import RolloutRounds
from megatron_osprey.models.target.decoding import TargetModel

from .config import SpecConfig, SpecResult
from .draft_session import DraftSession
from .generate import speculative_generate
from .tree import build_draft
from .verify import accept_sampling


class RecordingTarget(TargetModel):
    """Passes every call to `target` and records each chain verify round: greedy acceptance (temperature 0),
    else the number of drafts the engine keeps at its commit (None until then)."""

    def __init__(self, target: TargetModel, top_k: int, steps: int, temperature: float = 0.0):
        self.target, self.top_k, self.steps, self.greedy = target, top_k, steps, temperature == 0
        self.vocab_size = target.vocab_size
        self.rounds: list[dict] = []

    @property
    def cache_length(self) -> int:
        return self.target.cache_length

    def prefill(self, input_ids: torch.Tensor):
        self.rounds = []
        return self.target.prefill(input_ids)

    def verify(self, tokens: torch.Tensor, depths: torch.Tensor, allowed: torch.Tensor):
        if not torch.equal(depths.cpu(), torch.arange(tokens.numel())):
            raise ValueError("the rollout records chains only (SpecConfig.topk == 1).")
        root = self.target.cache_length  # x_root = tokens[0], the last verified token
        logits, aux = self.target.verify(tokens, depths, allowed)
        record = round_record(root - 1, tokens, logits, self.top_k)
        self.rounds.append(record if self.greedy else record | {"accepted": None})
        return logits, aux

    def commit(self, keep: list[int]) -> None:
        if not self.greedy:
            self.rounds[-1]["accepted"] = len(keep) - 1
        elif len(keep) - 1 != self.rounds[-1]["accepted"]:
            raise RuntimeError(
                f"the engine kept {len(keep) - 1} drafts where greedy acceptance gives {self.rounds[-1]['accepted']}."
            )
        self.target.commit(keep)


def round_record(root_row: int, tokens: torch.Tensor, logits: torch.Tensor, top_k: int, accepted=None) -> dict:
    """One chain verify round: tokens [root, d_1..d_K], the target's logits [K + 1, V] over them; `accepted`
    (None: greedy acceptance, the leading drafts equal to the target's argmax)."""
    drafts = tokens[1:].cpu()
    probs = torch.softmax(logits[:-1].double(), dim=-1)  # position j: after the root and d_1..d_j
    top = torch.topk(probs, top_k, dim=-1)
    if accepted is None:
        accepted = int((torch.argmax(logits[:-1], dim=-1).cpu() == drafts).long().cumprod(0).sum())
    return {
        "root_row": root_row,
        "accepted": accepted,
        "draft_tokens": drafts,
        "topk_ids": top.indices.cpu(),
        "topk_probs": top.values.float().cpu(),
    }


def stack_rounds(records: list[dict], steps: int, top_k: int) -> RolloutRounds:
    """RolloutRounds of round_record()s, in their order (none: empty tensors of the right shapes)."""
    if not records:
        empty = torch.zeros(0, dtype=torch.long)
        return RolloutRounds(
            empty, empty, empty.reshape(0, steps), empty.reshape(0, steps, top_k), torch.zeros(0, steps, top_k)
        )
    return RolloutRounds(
        root_rows=torch.tensor([r["root_row"] for r in records]),
        accepted=torch.tensor([r["accepted"] for r in records]),
        draft_tokens=torch.stack([r["draft_tokens"] for r in records]),
        topk_ids=torch.stack([r["topk_ids"] for r in records]),
        topk_probs=torch.stack([r["topk_probs"] for r in records]),
    )


@dataclasses.dataclass
class Rollout:
    """One prompt's rollout: the verified sequence (prompt + continuation), its loss mask and its rounds."""

    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool: the continuation
    rounds: RolloutRounds  # the live rounds and the replays, by root row
    result: SpecResult
    replays: int = 0  # rounds replayed from a rejection position


def rollout(
    target: TargetModel,
    drafter: DraftSession,
    prompt_ids: torch.Tensor,
    cfg: SpecConfig,
    top_k: int,
    replay: bool = True,
):
    """Chain speculative decoding of one prompt (greedy, or sampled at cfg.temperature from cfg.seed), recording
    its verify rounds (and, with `replay`, a round replayed from each rejection position: replay_rejections);
    a Rollout."""
    if cfg.topk != 1:
        raise ValueError("the rollout decodes chains: SpecConfig(topk=1).")
    recording = RecordingTarget(target, top_k, cfg.steps, cfg.temperature)
    prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().cpu()
    result = speculative_generate(recording, drafter, prompt_ids, cfg)
    input_ids = torch.cat([prompt_ids, torch.tensor(result.tokens, dtype=torch.long)])
    loss_mask = torch.arange(input_ids.numel()) >= prompt_ids.numel()
    live = recording.rounds
    if live and live[-1]["accepted"] is None:  # the last round is not committed: its kept drafts were emitted
        live[-1]["accepted"] = emitted_drafts(live[-1], input_ids)
    replayed = replay_rejections(target, drafter, input_ids, prompt_ids.numel(), live, cfg, top_k) if replay else []
    merged = sorted(live + replayed, key=lambda r: r["root_row"])
    return Rollout(input_ids, loss_mask, stack_rounds(merged, cfg.steps, top_k), result, len(replayed))


def emitted_drafts(record: dict, input_ids: torch.Tensor) -> int:
    """The leading drafts of a round that the sequence continues with (a rejected draft is never emitted: the
    token sampled in its place has no residual mass on it)."""
    start = record["root_row"] + 2  # x_{t+1} is the round's root token; d_1 would be x_{t+2}
    emitted = input_ids[start : start + record["draft_tokens"].numel()]
    drafts = record["draft_tokens"][: emitted.numel()]
    return int((drafts == emitted).long().cumprod(0).sum())


def replay_seed(seed: int) -> int:
    """The replays' sampling seed: a stream of its own, not the live decode's draws again."""
    return int.from_bytes(hashlib.sha256(f"replay\0{seed}".encode()).digest()[:8], "little") & (2**63 - 1)


def rejection_rows(live: list[dict], steps: int, num_tokens: int) -> list[int]:
    """The root rows of the replays: t + a for each live round (root row t) whose draft d_{a+1} was rejected
    after a >= 1 accepted drafts (a = 0: the round itself drafted from there), inside the sequence."""
    rows = [r["root_row"] + r["accepted"] for r in live if 0 < r["accepted"] < steps]
    return [q for q in rows if q + 1 < num_tokens]


@torch.no_grad()
def replay_rejections(
    target: TargetModel, drafter: DraftSession, input_ids: torch.Tensor, prompt_length: int, live, cfg, top_k: int
) -> list[dict]:
    """Draft again from each rejection position, now from the verified prefix, and record the target on it.

    Live round r (root row t, x_0..x_n verified, n = t + 1) drafted d_1..d_K; the target accepted a of them and
    rejected d_{a+1}, which the drafter proposed from its own states for d_1..d_a. The replay is the round
    the engine would run with x_0..x_n, d_1..d_a verified: root row t + a, the drafter reading the target's
    features of d_1..d_a, its fresh chain e_1..e_K, and the target's distribution after each e_1..e_j (step 0:
    the rejected position itself). One pass over the sequence: the target's cache and the draft session
    advance over the verified tokens, so the replays of a sample cost one target forward over it plus one
    chain verify each. Returns round_record()s (root rows increasing, each strictly between two live roots).
    """
    ids = input_ids.long().cpu()
    rows, records = rejection_rows(live, cfg.steps, ids.numel()), []
    if not rows:
        return records
    _, aux = target.prefill(ids[:prompt_length])
    cached, drafted, pending = prompt_length, 0, [aux]  # target cache x_0..x_{cached-1}; drafter rows < drafted
    generator = torch.Generator().manual_seed(replay_seed(cfg.seed))
    for q in rows:
        if q + 1 > cached:  # the verified tokens up to x_q join the target's cache, their features the drafter's
            n = q + 1 - cached
            _, aux = target.verify(ids[cached : q + 1], torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
            target.commit(list(range(n)))
            pending.append(aux)
            cached = q + 1
        features = torch.cat(pending)
        if drafted == 0:
            root_logits = drafter.start(ids[: q + 1], int(ids[q + 1]), features)
        else:
            root_logits = drafter.extend(ids[drafted + 1 : q + 2], features)
        drafted = q + 1
        tree = build_draft(drafter, root_logits, cfg, generator)
        drafter.end_round()
        tokens, depths, allowed = tree.verify_inputs(int(ids[q + 1]))
        logits, aux = target.verify(tokens, depths, allowed)
        accepted = None if cfg.temperature == 0 else len(accept_sampling(tree, logits, cfg.temperature, generator)[0])
        records.append(round_record(q, tokens, logits, top_k, accepted))
        target.commit([0])  # x_{q+1}: the next replay lies at least two rows on
        cached, pending = q + 2, [aux[:1]]
    return records


@torch.no_grad()
def target_states(model, input_ids: torch.Tensor, aux_layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh HF target forward over `input_ids` [T]: (aux [T, 3H], final pre-norm hidden [T, H]), as the
    extract stage stores them (the last decoder layer's output, before the final norm)."""
    captured = {}

    def hook(module, inputs, output):
        captured["final"] = output[0] if isinstance(output, tuple) else output

    handle = model.get_decoder().layers[-1].register_forward_hook(hook)  # a multimodal target's language model
    try:
        out = model(input_ids.to(model.device)[None], output_hidden_states=True)
    finally:
        handle.remove()
    aux = torch.cat([out.hidden_states[i + 1][0] for i in aux_layer_ids], dim=-1)
    return aux, captured["final"].reshape(input_ids.numel(), -1)


@torch.no_grad()
def megatron_target_states(target, input_ids: torch.Tensor, final_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """target_states for a MegatronTargetModel (one rank or a tensor-parallel group, with or without sequence
    parallelism): one causal forward over `input_ids` [T]; the final state is decoder layer `final_layer`'s
    output (the last layer, before the norm)."""
    from megatron_osprey.models.target.pipeline_stage import LayerCapture

    capture = LayerCapture(target.model, [final_layer])
    try:
        _, aux = target.prefill(input_ids)
        final = target.rows(capture.outputs[final_layer], input_ids.numel())
    finally:
        capture.remove()
    return aux, final


@torch.no_grad()
def fresh_target_distributions(model, input_ids: torch.Tensor, rounds: RolloutRounds, r: int) -> torch.Tensor:
    """Round r's target probabilities [K, V] from one fresh forward (no cache) over its prefix + drafts."""
    root = int(rounds.root_rows[r]) + 1
    tokens = torch.cat([input_ids[: root + 1], rounds.draft_tokens[r].long()])
    logits = model(tokens.to(model.device)[None]).logits[0]
    return torch.softmax(logits[root : root + rounds.draft_tokens.shape[1]].double(), dim=-1)
