"""Batched chain speculative decoding (topk 1, greedy): many requests share each target forward.

The reference engine (``generate.py``) decodes one request at a time, which
on a CPU spends most of its time in per-call overhead and small matrices.
Here B requests advance together: one target forward verifies every row's
draft chain, one drafter forward extends every row.

Rows accept different numbers of tokens, so their caches would drift apart.
Instead of rewriting caches, both the target and the drafter keep one shared,
preallocated cache whose slots are appended for every row alike, plus a
per-row validity mask: a slot is attended to only by the row that committed
it. A verify block of T tokens writes T slots for all rows; afterwards each
row marks valid only the slots of the tokens it accepted. Positions are per
row (the count of its valid slots), so RoPE sees exactly the positions the
batch-1 engine would use.

Greedy acceptance is the batch-1 rule per row: the longest prefix of the
chain that equals the target's argmax, plus the target's bonus token. The
output is therefore token-identical to target-only greedy decoding up to
floating-point reduction order (a batch of rows and a block of tokens sum
in another order than one row and one token).

The drafter side (BatchedDraftSession and its implementations) lives in ``batched_draft.py``.
"""

from __future__ import annotations

import torch

from megatron_osprey.models.target.decoding import has_sliding_window, text_config

from .batched_draft import BatchedDraftSession
from .config import SpecConfig, SpecResult
from .generate import emit_tokens


def _slot_cache_layer_class():
    from transformers.cache_utils import DynamicLayer

    class SlotLayer(DynamicLayer):
        """A preallocated HF cache layer: update() writes in place and returns views of the used slots."""

        def __init__(self, capacity: int):
            super().__init__()
            self.capacity, self.used = capacity, 0

        def lazy_initialization(self, key_states, value_states):
            b, h, _, d = key_states.shape
            self.keys = key_states.new_zeros(b, h, self.capacity, d)
            self.values = value_states.new_zeros(b, h, self.capacity, value_states.shape[-1])
            self.device, self.is_initialized = key_states.device, True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = key_states.shape[-2]
            if self.used + n > self.capacity:
                raise RuntimeError(f"batched KV cache is full ({self.capacity} slots); raise its capacity.")
            self.keys[:, :, self.used : self.used + n] = key_states
            self.values[:, :, self.used : self.used + n] = value_states
            self.used += n
            return self.keys[:, :, : self.used], self.values[:, :, : self.used]

        def get_seq_length(self) -> int:
            return self.used

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.is_initialized:
                self.keys = self.keys[indices]
                self.values = self.values[indices]

    return SlotLayer


class BatchedHFTarget:
    """A transformers causal LM over B rows: one preallocated KV cache plus per-row slot validity."""

    def __init__(self, model, aux_layer_ids: list[int], capacity: int):
        layers = text_config(model.config).num_hidden_layers
        if not all(0 <= i < layers for i in aux_layer_ids):
            raise ValueError(f"aux_layer_ids must lie in 0..{layers - 1}, got {aux_layer_ids}.")
        self.model, self.aux_layer_ids, self.capacity = model.eval(), list(aux_layer_ids), capacity
        self.cache = self.valid = self.positions = None
        self._block = None  # (first slot, tokens) of the last verify, until commit
        # Sliding-window layers (Mistral, Gemma 3, gpt-oss): an explicit mask replaces the model's own, so the
        # window is applied here, by position; slot_positions [B, capacity] holds each written slot's.
        config = text_config(model.config)
        self.window = config.sliding_window if has_sliding_window(config) else None
        self.layer_types = set(getattr(config, "layer_types", None) or ())
        self.slot_positions = None

    @property
    def length(self) -> int:
        """Slots written so far (valid or not)."""
        return self.cache.get_seq_length()

    def _forward(self, ids, positions, new_valid, logits_to_keep=0):
        """Run ids [B, T] as new slots; new_valid [B, T] says which of them are real tokens."""
        device = self.model.device
        b, t = ids.shape
        n = self.length
        causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        allowed = torch.cat(
            (
                self.valid[:, None, :n].expand(b, t, n),
                causal[None] & (new_valid[:, None, :] | torch.eye(t, dtype=torch.bool, device=device)),
            ),
            dim=2,
        )
        mask = self._additive(allowed)
        if self.window is not None:
            self.slot_positions[:, n : n + t] = positions.to(device)
            keys = self.slot_positions[:, : n + t]
            # transformers' sliding-window rule: a query at position p sees keys at positions above p - window.
            windowed = self._additive(allowed & (positions.to(device)[:, :, None] - keys[:, None, :] < self.window))
            # A model with layer types takes one mask per type; Mistral's layers are all windowed.
            mask = {"full_attention": mask, "sliding_attention": windowed} if self.layer_types else windowed
        out = self.model(
            ids.to(device),
            attention_mask=mask,
            position_ids=positions.to(device),
            cache=self.cache,
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=logits_to_keep,
        )
        aux = torch.cat([out.hidden_states[i + 1] for i in self.aux_layer_ids], dim=-1)
        return out.logits, aux

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """allowed [B, T, S] as the additive float mask [B, 1, T, S] transformers takes."""
        mask = torch.zeros(allowed.shape[0], 1, *allowed.shape[1:], dtype=self.model.dtype, device=allowed.device)
        return mask.masked_fill_(~allowed[:, None], torch.finfo(self.model.dtype).min)

    @torch.no_grad()
    def prefill(self, prompts: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Reset and run the prompts, left-padded; returns last-token logits [B, V] and each prompt's aux [n_b, F]."""
        from transformers.cache_utils import Cache

        layer = _slot_cache_layer_class()
        layers = text_config(self.model.config).num_hidden_layers
        self.cache = Cache(layers=[layer(self.capacity) for _ in range(layers)])
        lengths = torch.tensor([p.numel() for p in prompts])
        b, t = len(prompts), int(lengths.max())
        ids = torch.zeros(b, t, dtype=torch.long)
        pad = t - lengths
        for row, prompt in enumerate(prompts):
            ids[row, pad[row] :] = prompt
        columns = torch.arange(t)[None]
        new_valid = columns >= pad[:, None]
        positions = (columns - pad[:, None]).clamp(min=0)
        self.valid = torch.zeros(b, self.capacity, dtype=torch.bool, device=self.model.device)
        self.slot_positions = torch.zeros(b, self.capacity, dtype=torch.long, device=self.model.device)
        logits, aux = self._forward(ids, positions, new_valid.to(self.model.device), logits_to_keep=1)
        self.valid[:, :t] = new_valid
        self.positions = lengths.clone()
        return logits[:, -1], [aux[row, pad[row] :] for row in range(b)]

    @torch.no_grad()
    def verify(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A chain [B, T] after each row's committed tokens; returns logits [B, T, V] and aux [B, T, F]."""
        if self._block is not None:
            raise RuntimeError("BatchedHFTarget.verify called twice without commit in between.")
        b, t = tokens.shape
        positions = self.positions[:, None] + torch.arange(t)[None]
        self._block = (self.length, t)
        return self._forward(tokens, positions, torch.ones(b, t, dtype=torch.bool, device=self.model.device))

    def commit(self, keep: list[int]) -> None:
        """Row b keeps the first keep[b] tokens of the last verify in its cache."""
        start, t = self._block
        keep_t = torch.as_tensor(keep, dtype=torch.long)
        self.valid[:, start : start + t] = torch.arange(t)[None] < keep_t[:, None].to(self.valid.device)
        self.positions += keep_t
        self._block = None

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (finished requests leave the batch)."""
        index = torch.as_tensor(rows, dtype=torch.long)
        self.cache.batch_select_indices(index.to(self.model.device))
        self.valid, self.positions = self.valid[index.to(self.valid.device)], self.positions[index]
        self.slot_positions = self.slot_positions[index.to(self.slot_positions.device)]


def cache_capacity(prompts: list[torch.Tensor], cfg: SpecConfig, per_round: int) -> int:
    """Slots a batch can need: the longest prompt plus one round's slots per new token (each round gains >= 1)."""
    return max(p.numel() for p in prompts) + cfg.max_new_tokens * per_round + 1


def _decode_chains(
    session: BatchedDraftSession,
    prompts: list[torch.Tensor],
    first: list[int],
    prompt_aux: list[torch.Tensor],
    cfg: SpecConfig,
    judge,
    drop=None,
) -> list[SpecResult]:
    """The greedy chain loop shared by live and replayed decoding; results in prompt order.

    judge(live, drafts [B, steps], results) returns per live row the tokens the round commits (accepted
    drafts + bonus) and the target's aux rows for the drafter's extend; drop(rows) is told which rows stay
    whenever requests finish.
    """
    results = [SpecResult(tokens=[], verify_count=0) for _ in prompts]
    live = [i for i, token in enumerate(first) if not emit_tokens(results[i].tokens, [token], cfg)[1]]
    if not live:
        return results
    if len(live) < len(prompts) and drop is not None:
        drop(live)
    root = session.start([prompts[i] for i in live], [first[i] for i in live], [prompt_aux[i] for i in live])
    while live:
        judged = judge(live, session.draft(root, cfg.steps), results)
        still, new_tokens, new_aux = [], [], []
        for b, (i, (new, aux)) in enumerate(zip(live, judged)):
            result = results[i]
            result.verify_count += 1
            added, done = emit_tokens(result.tokens, new, cfg)
            result.accept_lengths.append(added)
            if not done:
                still.append(b)
                new_tokens.append(new)
                new_aux.append(aux)
        if not still:
            break
        if len(still) < len(live):
            if drop is not None:
                drop(still)
            session.select(still)
            live = [live[b] for b in still]
        root = session.extend(new_tokens, new_aux)
    return results


def _check_greedy_chain(cfg: SpecConfig, what: str) -> None:
    if cfg.topk != 1 or cfg.temperature != 0:
        raise ValueError(
            f"{what} greedy chains only (topk 1, temperature 0); got topk {cfg.topk}, temperature {cfg.temperature}."
        )


def batched_speculative_generate(
    target: BatchedHFTarget, session: BatchedDraftSession, prompts: list[torch.Tensor], cfg: SpecConfig
) -> list[SpecResult]:
    """Greedy chain speculative decoding of a batch; results in prompt order.

    The target and session must have been built with cache_capacity(prompts, cfg, per_round) slots
    (per_round: steps + 1 for the target, 2 * steps + 1 for the drafter).
    """
    _check_greedy_chain(cfg, "the batched engine decodes")
    prompts = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
    if any(p.numel() < 1 for p in prompts):
        raise ValueError("batched_speculative_generate needs non-empty prompts.")
    logits, aux = target.prefill(prompts)

    def verify(live, drafts, results):
        last = torch.tensor([results[i].tokens[-1] for i in live])
        verify_logits, verify_aux = target.verify(torch.cat((last[:, None], drafts), dim=1))
        best = verify_logits.argmax(-1).cpu()  # [B, steps + 1]
        accepted = (drafts == best[:, :-1]).long().cumprod(dim=1).sum(dim=1).tolist()
        target.commit([a + 1 for a in accepted])
        return [(drafts[b, :a].tolist() + [int(best[b, a])], verify_aux[b, : a + 1]) for b, a in enumerate(accepted)]

    return _decode_chains(session, prompts, logits.argmax(-1).tolist(), aux, cfg, verify, target.select)


@torch.no_grad()
def batched_target_generate(
    target: BatchedHFTarget, prompts: list[torch.Tensor], max_new_tokens: int, eos_token_ids: tuple[int, ...] = ()
) -> list[list[int]]:
    """Target-only greedy decoding of a batch (one token per row per forward); outputs in prompt order.

    The target must have been built with cache_capacity(prompts, cfg, 1) slots.
    """
    cfg = SpecConfig(max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids)
    prompts = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
    logits, _ = target.prefill(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    live = []
    for i, token in enumerate(logits.argmax(-1).tolist()):
        if not emit_tokens(outputs[i], [token], cfg)[1]:
            live.append(i)
    if len(live) < len(prompts) and live:
        target.select(live)
    while live:
        logits, _ = target.verify(torch.tensor([[outputs[i][-1]] for i in live]))
        target.commit([1] * len(live))
        still = [b for b, i in enumerate(live) if not emit_tokens(outputs[i], [int(logits[b, 0].argmax())], cfg)[1]]
        if len(still) < len(live) and still:
            target.select(still)
        live = [live[b] for b in still]
    return outputs


def replay_speculative_generate(
    session: BatchedDraftSession,
    prompts: list[torch.Tensor],
    references: list[list[int]],
    features: list[torch.Tensor],
    cfg: SpecConfig,
) -> list[SpecResult]:
    """Greedy chain speculative decoding of a batch, replayed against the target's own greedy output.

    Greedy verification commits the target's greedy text whatever the drafter proposes, and a causal
    target's hidden states at committed positions do not depend on rejected drafts. So given the
    target-only output r of each prompt (decoded with the same EOS ids and max_new_tokens) and the
    target's aux features over prompt + r[:-1] (`features[b]`: [n_b + len(r_b) - 1, F]), each round
    accepts the longest prefix of the drafter's chain equal to r's next tokens, adds r's next token as
    the bonus, and extends the drafter exactly as batched_speculative_generate does. The result (tokens,
    accept lengths, verify count) is the live engine's, up to floating-point differences between the
    target's full-sequence and incremental forwards; the target's work is one forward per prompt,
    shared by every drafter evaluated on it.
    """
    _check_greedy_chain(cfg, "replayed decoding covers")
    prompts = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
    for prompt, ref, feats in zip(prompts, references, features):
        if not ref or feats.shape[0] != prompt.numel() + len(ref) - 1:
            raise ValueError(
                f"replay needs each reference's features over prompt + reference[:-1]: "
                f"{prompt.numel()} + {len(ref)} - 1 rows, got {feats.shape[0]}."
            )
        if ref[-1] not in cfg.eos_token_ids and len(ref) < cfg.max_new_tokens:
            raise ValueError(
                f"replay: a reference ends after {len(ref)} tokens without an EOS id and short of "
                f"max_new_tokens {cfg.max_new_tokens}; decode it with the same settings."
            )
    lengths = [p.numel() for p in prompts]

    def replay(live, drafts, results):
        drafts, judged = drafts.tolist(), []
        for b, i in enumerate(live):
            ref, k = references[i], len(results[i].tokens)
            ahead = ref[k : k + cfg.steps]  # the target's greedy tokens after the committed ones
            a = 0
            while a < len(ahead) and drafts[b][a] == ahead[a]:
                a += 1
            judged.append((ref[k : k + a + 1], features[i][lengths[i] + k - 1 : lengths[i] + k + a]))
        return judged

    return _decode_chains(
        session, prompts, [ref[0] for ref in references], [f[:n] for f, n in zip(features, lengths)], cfg, replay
    )


@torch.no_grad()
def target_features(target: BatchedHFTarget, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """The target's aux features over each whole sequence [n_b, F] (one batched forward)."""
    return target.prefill(sequences)[1]
