"""The vocab-parallel TTT loss on the Megatron drafter equals a plain step-by-step reference."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_osprey.losses.ttt import (
    TTTLossConfig,
    drafter_inputs,
    step_mask,
    step_masks,
    ttt_loss,
    vocab_parallel_argmax,
)
from megatron_osprey.models.drafter.convert import load_reference_state
from megatron_osprey.models.drafter.model import build_drafter_model
from megatron_osprey.models.target.lm_head import TargetHead
from megatron_osprey.parallel import ParallelConfig, parallel_context
from tests.ttt_fixtures import TARGET_VOCAB, make_batch, make_drafter, make_target, reference_ttt_loss


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ttt_target")
    return directory, make_target(directory)


CONVENTIONS = [("predicted", "tokens"), ("reference", "reference"), ("reference", "tokens"), ("predicted", "reference")]


@pytest.mark.parametrize("alignment,normalization", CONVENTIONS)
@pytest.mark.parametrize("draft_vocab,steps", [(200, 5), (TARGET_VOCAB, 3)], ids=["reduced_k5", "full_k3"])
def test_megatron_ttt_loss_equals_step_by_step_reference(target, draft_vocab, steps, alignment, normalization):
    target_dir, hf = target
    arch, reference = make_drafter(draft_vocab)
    batch = make_batch()
    config = TTTLossConfig(ttt_steps=steps, mask_alignment=alignment, normalization=normalization)
    ids = drafter_inputs(batch["input_ids"])

    with torch.no_grad():
        full_target = hf.lm_head(hf.model.norm(batch["final_hidden"]))
    expected, expected_steps = reference_ttt_loss(
        reference.ttt_forward(ids, batch["aux_hidden"], steps), full_target, batch["loss_mask"], reference.t2d, config
    )

    with parallel_context(ParallelConfig()):
        model = build_drafter_model(arch, ParallelConfig())
        load_reference_state(model, reference.state_dict(), 0, 1)
        head = TargetHead.from_hf(target_dir, reference.t2d)
        draft_logits, in_draft = head(batch["final_hidden"])
        logits, _ = model.ttt_forward(ids, batch["aux_hidden"], steps)
        loss, metrics = ttt_loss(logits, draft_logits, batch["loss_mask"], in_draft, draft_vocab, config)
        loss.backward()
    assert abs(loss.item() - expected.item()) < 1e-5
    for k in range(steps):
        assert abs(metrics[f"ploss/{k}"].item() - expected_steps[k]) < 1e-5
    if draft_vocab < TARGET_VOCAB:  # the argmax-in-draft mask removed some rows
        assert not bool(in_draft.all()) and bool(in_draft.any())
    assert model.fusion_fc.weight.grad.abs().sum() > 0


def test_head_on_counted_rows_only_gives_the_same_loss_and_gradients(target):
    """Distillation runs the drafter's LM head on each step's counted rows only; nothing may change."""
    target_dir, _ = target
    arch, reference = make_drafter(200)
    batch = make_batch()
    config = TTTLossConfig(ttt_steps=3)
    ids = drafter_inputs(batch["input_ids"])
    results = []
    with parallel_context(ParallelConfig()):
        model = build_drafter_model(arch, ParallelConfig())
        load_reference_state(model, reference.state_dict(), 0, 1)
        head = TargetHead.from_hf(target_dir, reference.t2d)
        draft_logits, in_draft = head(batch["final_hidden"])
        rows = step_masks(batch["loss_mask"], in_draft, 3)
        assert 0 < sum(int(r.sum()) for r in rows) < 3 * rows[0].numel()  # some rows are skipped
        for selected in (None, rows):
            model.zero_grad()
            logits, _ = model.ttt_forward(ids, batch["aux_hidden"], 3, selected)
            loss, metrics = ttt_loss(logits, draft_logits, batch["loss_mask"], in_draft, 200, config)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            results.append((loss.detach(), metrics, grads))
    (full, full_metrics, full_grads), (part, part_metrics, part_grads) = results
    assert logits[0].dim() == 2 and logits[0].shape[0] == int(rows[0].sum())
    torch.testing.assert_close(part, full, atol=1e-6, rtol=1e-6)
    for key in full_metrics:
        torch.testing.assert_close(part_metrics[key].float(), full_metrics[key].float(), atol=1e-6, rtol=1e-6)
    assert full_grads.keys() == part_grads.keys() and "output_layer.weight" in full_grads
    for name, grad in full_grads.items():
        torch.testing.assert_close(part_grads[name], grad, atol=1e-6, rtol=1e-5)


def test_masks_follow_the_shift_convention():
    loss_mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    in_draft = torch.tensor([[1, 1, 0, 1, 1, 1]], dtype=torch.bool)
    # step 0, row t: needs loss_mask[t+2] and in_draft[t+1]
    assert step_mask(loss_mask, in_draft, 0).tolist() == [[True, False, True, False, False, False]]
    # step 1, row t: loss_mask[t+3], in_draft[t+2]
    assert step_mask(loss_mask, in_draft, 1).tolist() == [[False, True, False, False, False, False]]
    # SpecForge's alignment: loss_mask[t+k] (two tokens behind the predicted one), same in_draft
    assert step_mask(loss_mask, in_draft, 0, "reference").tolist() == [[True, False, True, True, True, False]]
    assert step_mask(loss_mask, in_draft, 1, "reference").tolist() == [[False, True, True, True, False, False]]


def test_default_conventions_are_pinned():
    config = TTTLossConfig()
    assert (config.ttt_steps, config.decay, config.mask_alignment, config.normalization) == (
        5,
        0.8,
        "predicted",
        "tokens",
    )
    with pytest.raises(ValueError, match="--ttt-normalization"):
        TTTLossConfig(normalization="mean")


@pytest.mark.parametrize("alignment,normalization", CONVENTIONS)
def test_trainer_and_ttt_loss_normalise_the_same_way(target, alignment, normalization):
    """The trainer's (sum, denominator) pair over two micro-batches equals ttt_loss on their concatenation
    (every step's loss counted the same way), for every convention."""
    from megatron_osprey.stages.distill import DistillConfig
    from megatron_osprey.training.distillation import distill_forward_step

    target_dir, _ = target
    arch, reference = make_drafter(200)
    batch = make_batch()
    cfg = DistillConfig()
    cfg.ttt = TTTLossConfig(ttt_steps=3, mask_alignment=alignment, normalization=normalization)
    with parallel_context(ParallelConfig()):
        model = build_drafter_model(arch, ParallelConfig())
        load_reference_state(model, reference.state_dict(), 0, 1)
        head = TargetHead.from_hf(target_dir, reference.t2d)
        step = distill_forward_step(None, head, cfg, arch.draft_vocab_size, None)
        numerator = denominator = 0
        with torch.no_grad():
            for row in range(batch["input_ids"].shape[0]):  # one micro-batch per row
                micro = {key: value[row : row + 1] for key, value in batch.items()}
                micro["lengths"] = torch.tensor([batch["input_ids"].shape[1]])
                loss, loss_func = step(iter([micro]), model)
                total, count, report = loss_func(loss)
                numerator, denominator = numerator + total, denominator + count
            draft_logits, in_draft = head(batch["final_hidden"])
            logits, _ = model.ttt_forward(drafter_inputs(batch["input_ids"]), batch["aux_hidden"], 3)
            expected, _ = ttt_loss(logits, draft_logits, batch["loss_mask"], in_draft, arch.draft_vocab_size, cfg.ttt)
    assert abs(numerator.item() / denominator.item() - expected.item()) < 1e-5
    if normalization == "reference":  # one per sample
        assert denominator.item() == batch["loss_mask"].shape[0]


def test_metrics_for_a_perfect_drafter():
    target = torch.randn(1, 8, 50)
    loss_mask = torch.ones(1, 8, dtype=torch.bool)
    drafter = [torch.cat([target[:, 1:], target[:, :1]], dim=1)]  # row t carries target row t+1
    _, metrics = ttt_loss(drafter, target, loss_mask, torch.ones_like(loss_mask), 50, TTTLossConfig(ttt_steps=1))
    assert metrics["acc/0"].item() == 1.0
    assert abs(metrics["accept/0"].item() - 1.0) < 1e-6
    assert metrics["tokens/0"].item() == 6


def test_argmax_respects_padding_columns():
    logits = torch.tensor([[0.0, 1.0, 5.0, 9.0]])  # column 3 is TP padding of a 3-token vocab
    assert vocab_parallel_argmax(logits, 3).item() == 2


class StorageTracker(TorchDispatchMode):
    """Bytes of the tensor storages alive (created under it) and their peak: every op's outputs are counted from
    their creation until their storage is freed, the tensors autograd saves included."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _release(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._release, key)
        return out


def _ttt_loss_peak(rows: int, vocab: int, steps: int, dtype, hidden: int) -> int:
    """Peak bytes over the real loss's forward and backward: each step's logits from a head, the float32 target."""
    from megatron_osprey.losses.ttt import ttt_step_terms

    gen = torch.Generator().manual_seed(0)
    states = [torch.randn(1, rows, hidden, generator=gen).to(dtype).requires_grad_() for _ in range(steps)]
    head = torch.randn(vocab, hidden, generator=gen).to(dtype).requires_grad_()
    everything = torch.ones(1, rows, dtype=torch.bool)
    with StorageTracker() as tracker:
        target = torch.randn(1, rows, vocab, generator=gen)  # the TargetHead's float32 logits
        logits = [state @ head.T for state in states]
        terms = ttt_step_terms(logits, target, everything, everything, vocab)
        del logits  # as after the forward step: only what the loss kept
        sum(term.loss_sum for term in terms).backward()
    return tracker.peak


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_plans_bytes_per_logit_entry_are_the_losss_measured_peak(dtype, monkeypatch):
    """The peak of the real loss over forward and backward at a small vocabulary: its growth per logit entry is
    the plan's per-entry figure exactly (beyond the head's own gradient, `hidden` values per vocabulary column),
    its growth per chunk entry the plan's chunk figure, and the rest (per-row scalars, indices, the states'
    gradients) is under 200 bytes per row, which at a real vocabulary is nothing."""
    from megatron_osprey.base.memory import TTT_LOSS_CHUNK_BYTES_PER_ENTRY, ttt_logits_bytes
    from megatron_osprey.losses import ttt

    rows, hidden, steps, width = 128, 4, 5, dtype.itemsize
    monkeypatch.setattr(ttt, "SOFT_CE_CHUNK_ENTRIES", 8000)
    monkeypatch.setattr("megatron_osprey.base.memory.TTT_LOSS_CHUNK_ENTRIES", 8000)
    small, large = _ttt_loss_peak(rows, 500, steps, dtype, hidden), _ttt_loss_peak(rows, 1000, steps, dtype, hidden)
    measured = (large - small) / (rows * 500) - hidden * width / rows
    planned = (ttt_logits_bytes(rows, 1000, steps, width) - ttt_logits_bytes(rows, 500, steps, width)) / (rows * 500)
    assert measured == planned == steps * width + 4 + width  # bf16, K=5: 16 bytes (the autograd formula kept 78)
    assert 0 < small - ttt_logits_bytes(rows, 500, steps, width) - hidden * width * 500 < 200 * rows
    monkeypatch.setattr(ttt, "SOFT_CE_CHUNK_ENTRIES", 16000)
    wider = _ttt_loss_peak(rows, 1000, steps, dtype, hidden)
    assert (wider - large) / 8000 == TTT_LOSS_CHUNK_BYTES_PER_ENTRY


def specforge_ttt_loss(logits, target, loss_mask, t2d, decay, lengths):
    """SpecForge's eagle3 objective, written from its formula, on each sample as its own batch of one.

    Per sample (its tokens up to its length, nothing padded): the target distribution and the inputs are
    shifted left by one, the loss mask is not; the position mask is loss_mask * t2d[argmax target]; step k
    reads the shifted target at t + k and the position mask shifted left k times; a step's loss is the
    masked soft CE summed over the vocabulary and averaged over all B*T rows; steps are weighted decay**k and
    summed; the update averages that over samples (micro-batches and ranks).
    """
    per_sample = []
    for b, length in enumerate(lengths):
        full = target[b, :length]
        shifted = torch.cat([full[1:], full.new_zeros(1, full.shape[-1])])  # target[t] = logits of x_{t+1}
        restricted = shifted[:, t2d]
        p = torch.softmax(restricted, dim=-1)
        p = torch.cat([p, p.new_full((len(logits), p.shape[-1]), 1.0 / p.shape[-1])])  # pad by K, uniform
        position_mask = loss_mask[b, :length].to(p.dtype) * t2d[shifted.argmax(-1)].to(p.dtype)
        position_mask[-1] = 0.0  # the last row has no next token
        total = 0.0
        for k, step_logits in enumerate(logits):
            log_q = torch.log_softmax(step_logits[b, :length], dim=-1)
            plogp = (p[k : k + length] * log_q).sum(-1)
            total = total + decay**k * -(position_mask * plogp).mean()
            position_mask = torch.cat([position_mask[1:], position_mask.new_zeros(1)])
        per_sample.append(total)
    return torch.stack(per_sample).mean()


def test_reference_normalization_is_specforges_per_sample_mean():
    """Ragged samples in two micro-batches padded past their ends, at float64: the trainer's (sum, denominator)
    pair equals SpecForge's per-sample objective, and 'tokens' does not."""
    from megatron_osprey.losses.ttt import ttt_objective, ttt_step_terms, within_lengths

    gen = torch.Generator().manual_seed(3)
    vocab, draft, steps, padded = 40, 25, 4, 24
    lengths = torch.tensor([24, 9, 17, 13, 5])
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.randperm(vocab, generator=gen)[:draft]] = True
    batch = len(lengths)
    target = 2 * torch.randn(batch, padded, vocab, generator=gen, dtype=torch.float64)
    logits = [torch.randn(batch, padded, draft, generator=gen, dtype=torch.float64) for _ in range(steps)]
    alive = torch.arange(padded)[None, :] < lengths[:, None]
    loss_mask = (torch.rand(batch, padded, generator=gen) > 0.3) & alive
    in_draft = t2d[target.argmax(-1)]
    assert 0 < int(in_draft[alive].sum()) < int(alive.sum())  # the draft vocabulary removes some rows
    # Some sample's last token is an assistant token and the target's argmax just past its end is drafted:
    # without within_lengths() that row would count.
    assert any(loss_mask[b, n - 1] and in_draft[b, n] for b, n in enumerate(lengths.tolist()) if n < padded)

    expected = specforge_ttt_loss(logits, target, loss_mask, t2d, 0.8, lengths.tolist())
    config = TTTLossConfig(ttt_steps=steps, mask_alignment="reference", normalization="reference")
    numerator = denominator = 0
    for part in (slice(0, 2), slice(2, 5)):  # two micro-batches, as the trainer sums them
        terms = ttt_step_terms(
            [x[part] for x in logits],
            target[part][..., t2d],
            loss_mask[part],
            in_draft[part] & within_lengths(lengths[part], padded),  # as the trainer does
            draft,
            mask_alignment="reference",
        )
        top, bottom = ttt_objective(terms, config, lengths[part])
        numerator, denominator = numerator + top, denominator + bottom
    assert abs((numerator / denominator).item() - expected.item()) < 1e-12
    loss, _ = ttt_loss(logits, target[..., t2d], loss_mask, in_draft, draft, config, lengths=lengths)
    assert abs(loss.item() - expected.item()) < 1e-12

    tokens, _ = ttt_loss(
        logits, target[..., t2d], loss_mask, in_draft, draft, TTTLossConfig(ttt_steps=steps, mask_alignment="reference")
    )
    assert abs(tokens.item() - expected.item()) > 1e-3


def _soft_ce_before(drafter_logits, target_logits, vocab_size):
    """The soft CE as written before its passes were cut (TP 1): mask both sides, max, exp, separate argmaxes."""
    valid = torch.arange(drafter_logits.shape[-1]) < vocab_size
    dtype = torch.promote_types(drafter_logits.dtype, torch.float32)
    q_logits = drafter_logits.to(dtype).masked_fill(~valid, float("-inf"))
    t_logits = target_logits.to(dtype).masked_fill(~valid, float("-inf"))
    t_exp = torch.exp(t_logits - t_logits.max(dim=-1).values[:, None])
    p = t_exp / t_exp.sum(dim=-1)[:, None]
    q_shift = q_logits - q_logits.max(dim=-1).values.detach()[:, None]
    log_z = torch.log(torch.exp(q_shift).sum(dim=-1))
    loss = log_z - (p * q_shift.masked_fill(~valid, 0.0)).sum(dim=-1)
    with torch.no_grad():
        accept = torch.minimum(p, torch.exp(q_shift - log_z[:, None])).sum(dim=-1)
        agree = vocab_parallel_argmax(drafter_logits.detach(), vocab_size) == vocab_parallel_argmax(
            target_logits.detach(), vocab_size
        )
    return loss, agree, accept


# Measured max |ours - reference| / max |reference| (the softmax is taken as exp(z - log-sum-exp), the
# gradient recomputed in backward): float64 1.7e-15, float32 and bf16 inputs 1.3e-6 (loss) and 1.1e-6 (grad).
SOFT_CE_TOLERANCE = {torch.float64: 1e-14, torch.float32: 3e-6, torch.bfloat16: 3e-6}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("padding", [0, 5], ids=["no_padding", "padding_columns"])
def test_soft_cross_entropy_equals_the_autograd_formula(dtype, padding, monkeypatch):
    """The recomputing soft CE against the autograd one it replaced: loss, gradient, agreement, acceptance at the
    measured error; one row per chunk gives the very same bits as one chunk."""
    from megatron_osprey.losses import ttt

    torch.manual_seed(0)
    rows, vocab = 37, 300
    target_logits = (torch.randn(rows, vocab + padding) * 3).to(dtype)
    target_logits[:4, 7] = target_logits[:4, 11] = 50.0  # ties: the lower id wins on both paths
    drafter_logits = (torch.randn(rows, vocab + padding) * 3).to(dtype)
    weights = torch.randn(rows, dtype=torch.promote_types(dtype, torch.float32))
    ref_in = drafter_logits.clone().requires_grad_()
    loss, agree, accept = _soft_ce_before(ref_in, target_logits, vocab)
    (loss * weights).sum().backward()
    results = []
    for chunk in (ttt.SOFT_CE_CHUNK_ENTRIES, vocab + padding):  # one chunk; one row per chunk
        monkeypatch.setattr(ttt, "SOFT_CE_CHUNK_ENTRIES", chunk)
        ours_in = drafter_logits.clone().requires_grad_()
        ours = ttt.vocab_parallel_soft_cross_entropy(ours_in, target_logits, vocab)
        (ours.loss * weights).sum().backward()
        results.append((ours.loss.detach(), ours.accept, ours_in.grad))
        tolerance = SOFT_CE_TOLERANCE[dtype]
        assert (ours.loss - loss).abs().max() <= tolerance * loss.abs().max()
        assert (ours.accept - accept).abs().max() <= tolerance * accept.abs().max()
        assert torch.equal(ours.agree, agree)
        assert ours_in.grad.dtype == dtype
        assert (ours_in.grad.double() - ref_in.grad.double()).abs().max() <= tolerance * ref_in.grad.abs().max()
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_counted_rows_read_the_same_target_rows_as_the_shifted_batch():
    """ttt_step_terms on counted rows only (gathered from the unshifted target) equals it on every row."""
    from megatron_osprey.losses.ttt import ttt_step_terms

    torch.manual_seed(1)
    b, s, vocab, steps = 3, 12, 50, 5
    target_logits = torch.randn(b, s, vocab)
    loss_mask = torch.rand(b, s) > 0.3
    in_draft = torch.rand(b, s) > 0.2
    every_row = [torch.randn(b, s, vocab) for _ in range(steps)]
    masks = step_masks(loss_mask, in_draft, steps)
    counted = [logits[mask] for logits, mask in zip(every_row, masks)]
    full = ttt_step_terms(every_row, target_logits, loss_mask, in_draft, vocab)
    rows = ttt_step_terms(counted, target_logits, loss_mask, in_draft, vocab)
    for a, c in zip(full, rows):
        assert int(a.count) == int(c.count) > 0
        assert torch.allclose(a.sample_loss, c.sample_loss) and torch.allclose(a.accept_sum, c.accept_sum)
        assert int(a.agree_sum) == int(c.agree_sum)
