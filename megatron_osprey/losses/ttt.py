"""The EAGLE-3 training-time-test (TTT) loss, vocab-parallel.

Alignment (one convention everywhere): the conversation is x_0..x_{s-1} with an
assistant mask m; the target's logits at position j predict x_{j+1}. Drafter row
t of TTT step k reads token x_{t+1+k} at position t+k (g from step k-1, or the
target's aux states at t for k=0) and is trained toward the target's
distribution at position t+1+k, restricted and renormalized to the draft
vocabulary, where the predicted token x_{t+2+k} is an assistant token and the
target's argmax is in the draft vocabulary. Step k is weighted decay^k (0.8).

Two conventions differ from the reference (SpecForge, which Osprey's release
trains with); each has a flag for the reference one, and `ttt_loss()` and the
trainer share `ttt_objective()`, so they normalise the same way:

* mask alignment, `mask_alignment`: "predicted" (default) counts row t of step
  k when the token it predicts, x_{t+2+k}, is an assistant token; "reference"
  counts it when x_{t+k} is (SpecForge shifts the target and the inputs by one
  but not the loss mask, so its mask trails the predicted token by two:
  specforge/core/eagle3.py, `_prepare_data` pads target and input_ids left by
  one, then every TTT step pads all three by one more).
* normalisation, `normalization`: "tokens" (default) divides the weighted sum
  of every step's losses by the number of counted rows of step 0 (summed over
  micro-batches and data-parallel ranks, Megatron's per-token contract);
  "reference" divides each sample's weighted sum by that sample's own length
  (every row, counted or not) and averages over samples. SpecForge takes the
  mean of each step over the micro-batch's B x T padded rows and averages the
  gradients over micro-batches and ranks; the release trains at batch size 1,
  where T is the sample's own (cut) length, and that per-sample form does not
  depend on how a global batch is split into micro-batches.

Logits arrive sharded over the (padded) draft vocabulary exactly like the
drafter's output layer; only per-row scalars cross TP ranks, never a vocabulary.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from megatron_osprey.base.memory import TTT_LOSS_CHUNK_ENTRIES
from megatron_osprey.losses.config import TTTLossConfig


def _tp(group):
    if group is None or not torch.distributed.is_initialized():
        return 1, 0
    return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


def _all_reduce(tensor: Tensor, group, op=torch.distributed.ReduceOp.SUM, differentiable: bool = False) -> Tensor:
    if _tp(group)[0] == 1:
        return tensor
    if differentiable:
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        return reduce_from_tensor_model_parallel_region(tensor, group)
    tensor = tensor.clone()
    torch.distributed.all_reduce(tensor, op=op, group=group)
    return tensor


def _valid_columns(local_vocab: int, vocab_size: int, group) -> Tensor | None:
    """Which of this rank's columns are real vocabulary (the rest is TP padding); None when all are."""
    _, rank = _tp(group)
    start = rank * local_vocab
    if start + local_vocab <= vocab_size:
        return None
    return torch.arange(start, start + local_vocab) < vocab_size


def _mask_padding(logits: Tensor, valid: Tensor | None, fill: float) -> Tensor:
    """logits with the padding columns set to `fill` (logits itself when there are none)."""
    return logits if valid is None else logits.masked_fill(~valid.to(logits.device), fill)


def _global_argmax(values: Tensor, index: Tensor, local: int, group) -> Tensor:
    """Global argmax ids from this rank's row maxima (values, index) over its local columns."""
    size, rank = _tp(group)
    if size == 1:
        return index
    index = index + rank * local
    best = _all_reduce(values, group, op=torch.distributed.ReduceOp.MAX)
    # The lowest global id among the ranks holding the max (torch.argmax's tie rule).
    candidate = torch.where(values == best, index, torch.full_like(index, torch.iinfo(index.dtype).max))
    return _all_reduce(candidate, group, op=torch.distributed.ReduceOp.MIN)


def vocab_parallel_argmax(logits: Tensor, vocab_size: int, group=None) -> Tensor:
    """Global argmax ids [...] of vocab-sharded logits [..., V/TP]; exchanges per-row scalars only."""
    local = logits.shape[-1]
    values, index = _mask_padding(logits, _valid_columns(local, vocab_size, group), float("-inf")).max(dim=-1)
    return _global_argmax(values, index, local, group)


@dataclasses.dataclass
class SoftCEResult:
    loss: Tensor  # [rows], differentiable
    agree: Tensor  # [rows] bool: drafter argmax == target argmax
    accept: Tensor  # [rows] sum_v min(p, q)


# Rows x local vocabulary entries one pass of the soft CE holds in float32 temporaries at a time (the plan's
# figure). The loss keeps no [rows, V] float32 tensor between passes: its forward saves the drafter's logits (as
# given) and per-row scalars, and its backward recomputes softmax(q) - p chunk by chunk into the logits' dtype.
SOFT_CE_CHUNK_ENTRIES = TTT_LOSS_CHUNK_ENTRIES


def _row_chunks(rows: int, local_vocab: int):
    step = max(1, SOFT_CE_CHUNK_ENTRIES // max(1, local_vocab))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _chunk_logits(logits: Tensor, rows: slice, index: Tensor | None, valid: Tensor | None, dtype) -> Tensor:
    """Rows `rows` (of `index` into logits when given) in the compute dtype, padding columns at -inf."""
    chunk = logits[rows] if index is None else logits[index[rows]]
    return _mask_padding(chunk.to(dtype), valid, float("-inf"))


def _finite(maxima: Tensor) -> Tensor:
    """Row maxima as softmax shifts: 0 where a rank's shard of a row has no finite logit (all padding or -inf)."""
    return torch.where(torch.isfinite(maxima), maxima, torch.zeros_like(maxima))


class _SoftCrossEntropy(torch.autograd.Function):
    """Per-row log Z_q - sum_v p_v (z_v - max z) over vocab-sharded logits, with the target's rows picked by
    `index` (None: row for row); the gradient is (softmax(z) - p) scaled by the rows' incoming gradient."""

    @staticmethod
    def forward(ctx, drafter_logits, target_logits, index, vocab_size, group):
        rows, local = drafter_logits.shape[0], drafter_logits.shape[-1]
        valid = _valid_columns(local, vocab_size, group)
        dtype = torch.promote_types(drafter_logits.dtype, torch.float32)
        chunks = _row_chunks(rows, local)
        # One pass: each side's local max (the softmax shift and the argmax) and its sum of exp relative to it;
        # the sums are then rescaled to the global max, so only per-row scalars cross TP ranks.
        stats = drafter_logits.new_empty((2, rows), dtype=dtype)  # local maxima of q and t
        sums = torch.empty_like(stats)
        q_index = torch.empty(rows, dtype=torch.long, device=drafter_logits.device)
        t_index = torch.empty_like(q_index)
        for part in chunks:
            for side, (logits, rows_of, arg) in enumerate(
                ((drafter_logits, None, q_index), (target_logits, index, t_index))
            ):
                chunk = _chunk_logits(logits, part, rows_of, valid, dtype)
                stats[side, part], arg[part] = chunk.max(dim=-1)
                sums[side, part] = torch.exp(chunk - _finite(stats[side, part])[:, None]).sum(-1)
        maxima = _all_reduce(stats, group, op=torch.distributed.ReduceOp.MAX)
        if _tp(group)[0] > 1:
            # A shard whose row is all masked (-inf max, zero sum) adds 0, never 0 * exp(large) = nan.
            scale = torch.where(torch.isfinite(stats), torch.exp(_finite(stats) - maxima), torch.zeros_like(stats))
            sums = _all_reduce(sums * scale, group)
        log_z = torch.log(sums[0])
        shifts = torch.stack([maxima[0] + log_z, maxima[1] + torch.log(sums[1])])  # log-softmax shifts of q and p
        terms = torch.empty_like(stats)  # sum_v p (z_v - max z) and sum_v min(p, q)
        for part in chunks:
            q_shift = _chunk_logits(drafter_logits, part, None, valid, dtype) - maxima[0, part, None]
            p = torch.exp(_chunk_logits(target_logits, part, index, valid, dtype) - shifts[1, part, None])
            # sum_v p log q = sum_v p (z_v - max) - log Z, since sum_v p = 1.
            terms[0, part] = (p * _mask_padding(q_shift, valid, 0.0)).sum(-1)
            terms[1, part] = torch.minimum(p, torch.exp(q_shift - log_z[part, None])).sum(-1)
        terms = _all_reduce(terms, group)
        loss = log_z - terms[0]
        # float32 keeps the order (and ties) of bf16 logits: the same argmax as on the logits as given.
        agree = _global_argmax(stats[0], q_index, local, group) == _global_argmax(stats[1], t_index, local, group)
        accept = terms[1]
        ctx.save_for_backward(drafter_logits, target_logits, index, shifts)
        ctx.vocab_size, ctx.group = vocab_size, group
        ctx.mark_non_differentiable(agree, accept)
        return loss, agree, accept

    @staticmethod
    def backward(ctx, grad_loss, _agree, _accept):
        drafter_logits, target_logits, index, shifts = ctx.saved_tensors
        local = drafter_logits.shape[-1]
        valid = _valid_columns(local, ctx.vocab_size, ctx.group)
        dtype = shifts.dtype
        grad = torch.empty_like(drafter_logits)
        for part in _row_chunks(drafter_logits.shape[0], local):
            q = torch.exp(_chunk_logits(drafter_logits, part, None, valid, dtype) - shifts[0, part, None])
            q -= torch.exp(_chunk_logits(target_logits, part, index, valid, dtype) - shifts[1, part, None])
            grad[part] = q.mul_(grad_loss[part, None].to(dtype))
        return grad, None, None, None, None


def vocab_parallel_soft_cross_entropy(
    drafter_logits: Tensor, target_logits: Tensor, vocab_size: int, group=None, target_rows: Tensor | None = None
) -> SoftCEResult:
    """Per-row -sum_v p_target(v) log q_drafter(v) over the real vocab columns, drafter_logits [rows, V/TP].

    target_logits: [rows, V/TP], or with `target_rows` [rows] the table [N, V/TP] those rows index (each step's
    rows are then read in place, never copied out whole). Only per-row scalars cross TP ranks; the float32
    work runs over SOFT_CE_CHUNK_ENTRIES entries at a time, and what stays for backward is drafter_logits itself
    (the target's logits are the caller's) plus four scalars per row.
    """
    loss, agree, accept = _SoftCrossEntropy.apply(drafter_logits, target_logits, target_rows, vocab_size, group)
    return SoftCEResult(loss=loss, agree=agree, accept=accept)


def shift_rows(tensor: Tensor, k: int, fill=0) -> Tensor:
    """tensor[:, k:] padded back to length s with `fill` (rows t >= s-k become padding)."""
    if k == 0:
        return tensor
    pad_shape = (tensor.shape[0], min(k, tensor.shape[1]), *tensor.shape[2:])
    return torch.cat([tensor[:, k:], tensor.new_full(pad_shape, fill)], dim=1)


def drafter_inputs(input_ids: Tensor) -> Tensor:
    """Drafter step-0 input ids: row t holds x_{t+1} (the token the target produced at t)."""
    return shift_rows(input_ids, 1)


def within_lengths(lengths: Tensor, seq_length: int) -> Tensor:
    """[b, s] True at each sample's own positions, False on its padding.

    The target's argmax on a pad position is no distribution to learn, but the reference alignment's mask
    (x_{t+k}) does not rule out a row trained toward the position just past a sample's end: AND this into
    target_in_draft.
    """
    return torch.arange(seq_length, device=lengths.device)[None, :] < lengths[:, None]


def step_mask(loss_mask: Tensor, target_in_draft: Tensor, k: int, mask_alignment: str = "predicted") -> Tensor:
    """Rows of step k that count: target argmax(t+1+k) is drafted and x_{t+2+k} ("predicted") or x_{t+k}
    ("reference") is an assistant token."""
    offset = 2 + k if mask_alignment == "predicted" else k
    return shift_rows(loss_mask.bool(), offset, False) & shift_rows(target_in_draft.bool(), 1 + k, False)


@dataclasses.dataclass
class TTTStepTerms:
    """Sums over the counted rows of one TTT step (loss differentiable, the rest detached)."""

    sample_loss: Tensor  # [b]: each sample's loss sum over its counted rows
    count: Tensor
    agree_sum: Tensor
    accept_sum: Tensor

    @property
    def loss_sum(self) -> Tensor:
        return self.sample_loss.sum()


def step_masks(
    loss_mask: Tensor, target_in_draft: Tensor, steps: int, mask_alignment: str = "predicted"
) -> list[Tensor]:
    """step_mask() of every TTT step: the rows whose logits the loss reads."""
    return [step_mask(loss_mask, target_in_draft, k, mask_alignment) for k in range(steps)]


def ttt_step_terms(
    drafter_logits: list[Tensor],
    target_logits: Tensor,
    loss_mask: Tensor,
    target_in_draft: Tensor,
    draft_vocab_size: int,
    group=None,
    mask_alignment: str = "predicted",
) -> list[TTTStepTerms]:
    """Per-step sums of the soft CE, the argmax agreement and sum min(p, q) over counted rows.

    drafter_logits[k]: step k of the unroll, either [b, s, Vd/TP] (every row) or [n_k, Vd/TP]
    (only step k's counted rows, step_masks()[k], in (b, s) order: the same sums for less work);
    target_logits [b, s, Vd/TP]: the target's logits restricted to the draft vocabulary at every
    position; loss_mask [b, s]: assistant tokens x_j; target_in_draft [b, s]: the target's
    (full-vocabulary) argmax at j lies in the draft vocabulary.
    """
    terms = []
    b, s = loss_mask.shape
    table = target_logits.reshape(b * s, target_logits.shape[-1])  # read in place by row index, never copied
    position = torch.arange(b * s, device=target_logits.device).reshape(b, s)
    for k, logits in enumerate(drafter_logits):
        mask = step_mask(loss_mask, target_in_draft, k, mask_alignment)
        # Which sample each row belongs to, in the order of the rows given.
        sample = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)
        # Row t reads the target at t+1+k; the mask's last 1+k rows are False (step_mask), so those rows may read
        # any finite row (the sample's last) in place of shift_rows()' zeros: they are multiplied by zero.
        rows = shift_rows(position, 1 + k, 0)
        rows[:, s - min(1 + k, s) :] = position[:, -1:]
        if logits.dim() == 2:  # counted rows only: every row given counts
            if logits.shape[0] != int(mask.sum()):
                raise ValueError(f"TTT step {k}: {logits.shape[0]} drafter rows for {int(mask.sum())} counted rows.")
            rows, sample = rows[mask], sample[mask]
            mask = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        else:
            logits, rows, mask, sample = (
                logits.reshape(-1, logits.shape[-1]),
                rows.reshape(-1),
                mask.reshape(-1),
                sample.reshape(-1),
            )
        terms.append(
            soft_ce_terms(logits, table, mask, sample, b, draft_vocab_size, group, target_rows=rows.to(table.device))
        )
    return terms


def soft_ce_terms(
    logits: Tensor,
    target: Tensor,
    mask: Tensor,
    sample: Tensor,
    samples: int,
    draft_vocab_size: int,
    group=None,
    target_rows: Tensor | None = None,
) -> TTTStepTerms:
    """One TTT step's sums over the rows `mask` counts: the soft CE per sample (rows belong to `sample`), the
    count, the argmax agreement and sum min(p, q). logits: [n, Vd/TP]; target: [n, Vd/TP], or the table
    `target_rows` [n] indexes; mask, sample: [n]."""
    result = vocab_parallel_soft_cross_entropy(logits, target, draft_vocab_size, group, target_rows)
    masked = result.loss * mask
    return TTTStepTerms(
        sample_loss=masked.new_zeros(samples).index_add(0, sample, masked),
        count=mask.sum().detach(),
        agree_sum=(result.agree & mask).sum().detach(),
        accept_sum=(result.accept * mask).sum().detach(),
    )


def ttt_objective(terms: list[TTTStepTerms], config: TTTLossConfig, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """(numerator, denominator) of the TTT loss of one micro-batch whose samples are `lengths` [b] tokens long.

    "tokens": sum_k decay^k * loss_sum_k over step 0's counted rows. "reference": the sum over samples of
    sum_k decay^k * sample_loss_k / length, over the number of samples. Summed over micro-batches and ranks
    before dividing, as Megatron's per-token loss contract does.
    """
    weights = config.weights()
    if config.normalization == "reference":
        per_sample = sum(weight * term.sample_loss for weight, term in zip(weights, terms))
        numerator = (per_sample / lengths.to(per_sample.device, per_sample.dtype)).sum()
        return numerator, torch.tensor(lengths.numel(), device=terms[0].count.device)
    numerator = sum(weight * term.loss_sum for weight, term in zip(weights, terms))
    return numerator, terms[0].count


def ttt_loss(
    drafter_logits: list[Tensor],
    target_logits: Tensor,
    loss_mask: Tensor,
    target_in_draft: Tensor,
    draft_vocab_size: int,
    config: TTTLossConfig,
    group=None,
    lengths: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The TTT loss of one batch (ttt_objective's ratio), and per-step metrics (ploss_k, acc_k, accept_k, tokens_k).

    lengths [b]: each sample's length before padding (default: the batch's length for every sample).
    """
    if lengths is None:
        lengths = torch.full((loss_mask.shape[0],), loss_mask.shape[1], device=loss_mask.device)
    target_in_draft = target_in_draft & within_lengths(lengths, loss_mask.shape[1]).to(target_in_draft.device)
    terms = ttt_step_terms(
        drafter_logits, target_logits, loss_mask, target_in_draft, draft_vocab_size, group, config.mask_alignment
    )
    numerator, denominator = ttt_objective(terms, config, lengths)
    total = numerator / denominator.clamp(min=1).to(torch.float32)
    metrics: dict[str, Tensor] = {}
    for k, term in enumerate(terms):
        denominator = term.count.clamp(min=1).to(torch.float32)
        step_loss = term.loss_sum / denominator
        metrics[f"ploss/{k}"] = step_loss.detach()
        metrics[f"acc/{k}"] = term.agree_sum / denominator
        metrics[f"accept/{k}"] = term.accept_sum / denominator
        metrics[f"tokens/{k}"] = term.count
    return total, metrics
