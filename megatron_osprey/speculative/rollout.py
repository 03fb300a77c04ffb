"""Target-assisted rollout for Draft-OPD: greedy chain speculative decoding that records every verify round.

The continuation is the target's own (greedy, lossless: every emitted token is verified), so the rollout
never leaves the target's distribution; what it records is where the drafter's own proposals lead. Each
verify round gives (data/hidden_state_store/rollout.py has the store layout):

* the root row n - 1 (x_0..x_n verified, x_n not yet in the target's cache), the drafted d_1..d_K;
* the target's distribution at each drafted position j = 0..K-1 (after x_0..x_n, d_1..d_j): the verify
  forward's own logits, kept as the top-k probabilities of the full-vocabulary softmax (float32);
* how many drafts the target accepted (the greedy chain rule: the leading drafts equal to its argmax).

It wraps the engine's target (a TargetModel), so the engine itself is unchanged: `speculative_generate`
drives the recording target exactly as it drives the plain one.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_osprey.data.hidden_state_store.rollout import RolloutRounds
from megatron_osprey.models.target.decoding import TargetModel

from .config import SpecConfig, SpecResult
from .draft_session import DraftSession
from .generate import speculative_generate


class RecordingTarget(TargetModel):
    """Passes every call to `target` and records each chain verify round (greedy acceptance)."""

    def __init__(self, target: TargetModel, top_k: int, steps: int):
        self.target, self.top_k, self.steps = target, top_k, steps
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
        drafts = tokens[1:].cpu()
        probs = torch.softmax(logits[:-1].double(), dim=-1)  # position j: after the root and d_1..d_j
        top = torch.topk(probs, self.top_k, dim=-1)
        agree = (torch.argmax(logits[:-1], dim=-1).cpu() == drafts).long()
        self.rounds.append(
            {
                "root_row": root - 1,
                "accepted": int(agree.cumprod(0).sum()),
                "draft_tokens": drafts,
                "topk_ids": top.indices.cpu(),
                "topk_probs": top.values.float().cpu(),
            }
        )
        return logits, aux

    def commit(self, keep: list[int]) -> None:
        if len(keep) - 1 != self.rounds[-1]["accepted"]:
            raise RuntimeError(
                f"the engine kept {len(keep) - 1} drafts where greedy acceptance gives {self.rounds[-1]['accepted']}."
            )
        self.target.commit(keep)

    def recorded(self) -> RolloutRounds:
        """The rounds since the last prefill."""
        if not self.rounds:  # the first token ended the generation
            k, steps = self.top_k, self.steps
            empty = torch.zeros(0, dtype=torch.long)
            return RolloutRounds(
                empty, empty, empty.reshape(0, steps), empty.reshape(0, steps, k), torch.zeros(0, steps, k)
            )
        return RolloutRounds(
            root_rows=torch.tensor([r["root_row"] for r in self.rounds]),
            accepted=torch.tensor([r["accepted"] for r in self.rounds]),
            draft_tokens=torch.stack([r["draft_tokens"] for r in self.rounds]),
            topk_ids=torch.stack([r["topk_ids"] for r in self.rounds]),
            topk_probs=torch.stack([r["topk_probs"] for r in self.rounds]),
        )


@dataclasses.dataclass
class Rollout:
    """One prompt's rollout: the verified sequence (prompt + continuation), its loss mask and its rounds."""

    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool: the continuation
    rounds: RolloutRounds
    result: SpecResult


def rollout(target: TargetModel, drafter: DraftSession, prompt_ids: torch.Tensor, cfg: SpecConfig, top_k: int):
    """Greedy chain speculative decoding of one prompt, recording its verify rounds; a Rollout."""
    if cfg.topk != 1 or cfg.temperature != 0:
        raise ValueError("the rollout is greedy chain decoding: SpecConfig(topk=1, temperature=0).")
    recording = RecordingTarget(target, top_k, cfg.steps)
    prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().cpu()
    result = speculative_generate(recording, drafter, prompt_ids, cfg)
    input_ids = torch.cat([prompt_ids, torch.tensor(result.tokens, dtype=torch.long)])
    loss_mask = torch.arange(input_ids.numel()) >= prompt_ids.numel()
    return Rollout(input_ids, loss_mask, recording.recorded(), result)


@torch.no_grad()
def target_states(model, input_ids: torch.Tensor, aux_layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh HF target forward over `input_ids` [T]: (aux [T, 3H], final pre-norm hidden [T, H]), as the
    extract stage stores them (the last decoder layer's output, before the final norm)."""
    captured = {}

    def hook(module, inputs, output):
        captured["final"] = output[0] if isinstance(output, tuple) else output

    handle = model.model.layers[-1].register_forward_hook(hook)
    try:
        out = model(input_ids.to(model.device)[None], output_hidden_states=True)
    finally:
        handle.remove()
    aux = torch.cat([out.hidden_states[i + 1][0] for i in aux_layer_ids], dim=-1)
    return aux, captured["final"].reshape(input_ids.numel(), -1)


@torch.no_grad()
def fresh_target_distributions(model, input_ids: torch.Tensor, rounds: RolloutRounds, r: int) -> torch.Tensor:
    """Round r's target probabilities [K, V] from one fresh forward (no cache) over its prefix + drafts."""
    root = int(rounds.root_rows[r]) + 1
    tokens = torch.cat([input_ids[: root + 1], rounds.draft_tokens[r].long()])
    logits = model(tokens.to(model.device)[None]).logits[0]
    return torch.softmax(logits[root : root + rounds.draft_tokens.shape[1]].double(), dim=-1)
