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
  but not the loss mask, so its mask trails the predicted token by two).
* normalisation, `normalization`: "tokens" (default) divides the weighted sum
  of every step's losses by the number of counted rows of step 0 (summed over
  micro-batches and data-parallel ranks, Megatron's per-token contract);
  "reference" divides each step by all B*T rows, counted or not.

Logits arrive sharded over the (padded) draft vocabulary exactly like the
drafter's output layer; only per-row scalars cross TP ranks, never a vocabulary.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

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


def _valid_columns(local_vocab: int, vocab_size: int, group) -> Tensor:
    """Which of this rank's columns are real vocabulary (the rest is TP padding)."""
    _, rank = _tp(group)
    start = rank * local_vocab
    return torch.arange(start, start + local_vocab) < vocab_size


def vocab_parallel_argmax(logits: Tensor, vocab_size: int, group=None) -> Tensor:
    """Global argmax ids [...] of vocab-sharded logits [..., V/TP]; exchanges per-row scalars only."""
    local = logits.shape[-1]
    masked = logits.masked_fill(~_valid_columns(local, vocab_size, group).to(logits.device), float("-inf"))
    values, index = masked.max(dim=-1)
    size, rank = _tp(group)
    if size == 1:
        return index
    index = index + rank * local
    best = _all_reduce(values, group, op=torch.distributed.ReduceOp.MAX)
    # The lowest global id among the ranks holding the max (torch.argmax's tie rule).
    candidate = torch.where(values == best, index, torch.full_like(index, torch.iinfo(index.dtype).max))
    return _all_reduce(candidate, group, op=torch.distributed.ReduceOp.MIN)


@dataclasses.dataclass
class SoftCEResult:
    loss: Tensor  # [rows], differentiable
    agree: Tensor  # [rows] bool: drafter argmax == target argmax
    accept: Tensor  # [rows] sum_v min(p, q)


def vocab_parallel_soft_cross_entropy(
    drafter_logits: Tensor, target_logits: Tensor, vocab_size: int, group=None
) -> SoftCEResult:
    """Per-row -sum_v p_target(v) log q_drafter(v) over the real vocab columns, both [rows, V/TP]."""
    valid = _valid_columns(drafter_logits.shape[-1], vocab_size, group).to(drafter_logits.device)
    q_logits = drafter_logits.float().masked_fill(~valid, float("-inf"))
    t_logits = target_logits.float().masked_fill(~valid, float("-inf"))

    t_max = _all_reduce(t_logits.max(dim=-1).values, group, op=torch.distributed.ReduceOp.MAX)
    t_exp = torch.exp(t_logits - t_max[:, None])
    p = t_exp / _all_reduce(t_exp.sum(dim=-1), group)[:, None]

    q_max = _all_reduce(q_logits.max(dim=-1).values.detach(), group, op=torch.distributed.ReduceOp.MAX)
    q_shift = q_logits - q_max[:, None]
    q_sum = _all_reduce(torch.exp(q_shift).sum(dim=-1), group, differentiable=True)
    log_z = torch.log(q_sum)
    # sum_v p log q = sum_v p (z_v - max) - log Z, since sum_v p = 1.
    expected_logit = _all_reduce((p * q_shift.masked_fill(~valid, 0.0)).sum(dim=-1), group, differentiable=True)
    loss = log_z - expected_logit

    with torch.no_grad():
        q = torch.exp(q_shift - log_z[:, None])
        accept = _all_reduce(torch.minimum(p, q).sum(dim=-1), group)
        agree = vocab_parallel_argmax(drafter_logits.detach(), vocab_size, group) == vocab_parallel_argmax(
            target_logits.detach(), vocab_size, group
        )
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


def step_mask(loss_mask: Tensor, target_in_draft: Tensor, k: int, mask_alignment: str = "predicted") -> Tensor:
    """Rows of step k that count: target argmax(t+1+k) is drafted and x_{t+2+k} ("predicted") or x_{t+k}
    ("reference") is an assistant token."""
    offset = 2 + k if mask_alignment == "predicted" else k
    return shift_rows(loss_mask.bool(), offset, False) & shift_rows(target_in_draft.bool(), 1 + k, False)


@dataclasses.dataclass
class TTTStepTerms:
    """Sums over the counted rows of one TTT step (loss differentiable, the rest detached)."""

    loss_sum: Tensor
    count: Tensor
    agree_sum: Tensor
    accept_sum: Tensor


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
    for k, logits in enumerate(drafter_logits):
        mask = step_mask(loss_mask, target_in_draft, k, mask_alignment)
        target_k = shift_rows(target_logits, 1 + k)
        if logits.dim() == 2:  # counted rows only: every row given counts
            if logits.shape[0] != int(mask.sum()):
                raise ValueError(f"TTT step {k}: {logits.shape[0]} drafter rows for {int(mask.sum())} counted rows.")
            target_k = target_k[mask]
            mask = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        else:
            logits, target_k, mask = (
                logits.reshape(-1, logits.shape[-1]),
                target_k.reshape(-1, target_logits.shape[-1]),
                mask.reshape(-1),
            )
        result = vocab_parallel_soft_cross_entropy(logits, target_k, draft_vocab_size, group)
        terms.append(
            TTTStepTerms(
                loss_sum=(result.loss * mask).sum(),
                count=mask.sum().detach(),
                agree_sum=(result.agree & mask).sum().detach(),
                accept_sum=(result.accept * mask).sum().detach(),
            )
        )
    return terms


def ttt_objective(terms: list[TTTStepTerms], config: TTTLossConfig, rows: int) -> tuple[Tensor, Tensor]:
    """(numerator, denominator) of the TTT loss of one micro-batch of `rows` = B*T rows.

    The numerator is sum_k decay^k * loss_sum_k; the denominator is step 0's counted rows
    ("tokens") or B*T ("reference"). Summed over micro-batches and ranks before dividing,
    as Megatron's per-token loss contract does.
    """
    numerator = sum(weight * term.loss_sum for weight, term in zip(config.weights(), terms))
    if config.normalization == "reference":
        denominator = torch.tensor(rows, device=terms[0].count.device)
    else:
        denominator = terms[0].count
    return numerator, denominator


def ttt_loss(
    drafter_logits: list[Tensor],
    target_logits: Tensor,
    loss_mask: Tensor,
    target_in_draft: Tensor,
    draft_vocab_size: int,
    config: TTTLossConfig,
    group=None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The TTT loss of one batch (ttt_objective's ratio), and per-step metrics (ploss_k, acc_k, accept_k, tokens_k)."""
    terms = ttt_step_terms(
        drafter_logits, target_logits, loss_mask, target_in_draft, draft_vocab_size, group, config.mask_alignment
    )
    numerator, denominator = ttt_objective(terms, config, loss_mask.numel())
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
